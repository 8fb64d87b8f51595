"""argparse ``type=`` functions that check a number's range while the command line is parsed.

A value out of range then fails like any other argparse error: one line naming the argument and
what it allows (``argument --batches: must be at least 1 (a whole number), got -1``), exit code
2, before any file is read or written. Free of torch, like the rest of the command line's
parsing, so that a bad argument is reported at once.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable


def int_at_least(low: int, meaning: str = "") -> Callable[[str], int]:
    """A whole number ``>= low``; ``meaning`` (e.g. ``"0 = off"``) is added to the message."""
    allowed = f"at least {low} (a whole number{'; ' + meaning if meaning else ''})"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


def float_in(low: float, high: float | None = None, *, low_open: bool = False,
             high_open: bool = False) -> Callable[[str], float]:
    """A finite number from ``low`` to ``high`` (None: no upper end); ``*_open`` leaves that end
    out."""
    if high is not None:
        allowed = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    else:
        allowed = f"a number {'above' if low_open else 'at least'} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        # nan passes no comparison below and inf no arithmetic that follows (MB to bytes, a
        # probability): both are refused like any value out of range.
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
            high is None or (value < high if high_open else value <= high))
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    parse.__name__ = "float_" + re.sub(r"\W+", "_", allowed).strip("_")
    return parse


positive_int = int_at_least(1)
"""A whole number >= 1: counts and sizes (batches, rows, heads, tokens)."""
positive_int.__name__ = "positive_int"

non_negative_int = int_at_least(0)
"""A whole number >= 0: seeds, and sizes where 0 means "the default"."""
non_negative_int.__name__ = "non_negative_int"

unit_float = float_in(0.0, 1.0, low_open=True)
"""A number in (0, 1]: a probability mass such as top-p (1 = everything)."""
unit_float.__name__ = "unit_float"

open_unit_float = float_in(0.0, 1.0, low_open=True, high_open=True)
"""A number in (0, 1): a fraction that must leave something on both sides (--val-frac)."""
open_unit_float.__name__ = "open_unit_float"

non_negative_float = float_in(0.0)
"""A finite number >= 0: a temperature (0 = greedy), a size in MB (0 = no limit)."""
non_negative_float.__name__ = "non_negative_float"


def config_args(p: argparse.ArgumentParser, what: str = "") -> None:
    """``--preset``, ``--config`` and ``--set``: how every command that builds a config reads it
    (``archlab.config.make_config(args.preset, args.config, args.overrides)``)."""
    p.add_argument("--preset", default="tiny",
                   help=f"named preset{what}: tiny, 20m, 70m, 124m, 350m, 1b (default tiny)")
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML config file(s) applied over the preset, in order")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override one key, e.g. --set model.n_layers=8 (repeatable)")
