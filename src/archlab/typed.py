"""Typed trees: the one validator and the one merge rule behind configs and suite files.

A config (or a suite section) is a dataclass; a file or ``--set`` gives a nested mapping. ``build``
checks every key and value against the dataclass's annotations and fails with one line naming the
key and what is allowed; ``merge`` layers mappings (later wins, nested mappings merge). Both are
free of torch, so the command line can check a config without importing it.

``Reporter`` decides how a failure reads: ``config error: model.n_heads: ...`` for configs,
``suite error: FILE: eval.alpha: ...`` for suites.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Callable, Literal, NoReturn

from archlab.errors import ConfigError

# What YAML 1.1 (PyYAML) leaves as a string but every user means as a number: ``3e-4``, ``1E5``,
# ``.5e-3`` (YAML wants a dot *and* a signed exponent), plus ``inf``/``nan`` spellings.
# Python's float spellings (digits grouped by single underscores, as in 1_000e-6, included), which
# YAML 1.1 leaves a string when they have no dot (3e-4, 1E5, 1_000e-6)
_DIGITS = r"\d(?:_?\d)*"
_FLOAT_TEXT = re.compile(rf"^[+-]?({_DIGITS}(\.({_DIGITS})?)?|\.{_DIGITS})([eE][+-]?{_DIGITS})?$")


class Reporter:
    """Formats failures: ``{prefix}{key}: {message}``; subclass or pass another prefix."""

    def __init__(self, prefix: str = "config error: ") -> None:
        self.prefix = prefix

    def fail(self, key: str, message: str) -> NoReturn:
        raise ConfigError(f"{self.prefix}{key or '(top level)'}: {message}")

    def unknown(self, key: str, allowed: list[str]) -> NoReturn:
        raise ConfigError(f"{self.prefix}unknown key {key!r}; allowed here: {', '.join(allowed)}")


CONFIG = Reporter()


def check(ok: bool, key: str, message: str, reporter: Reporter = CONFIG) -> None:
    """Fail with ``key: message`` unless ``ok``."""
    if not ok:
        reporter.fail(key, message)


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return (x + m - 1) // m * m


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive mapping merge: ``over`` wins, nested mappings merge key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def describe(tp: Any) -> str:
    """How an annotation reads in an error message."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"a list of {describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def as_float(value: Any) -> float | None:
    """``value`` as a float when it is a number or a number's spelling, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if _FLOAT_TEXT.match(text):
            return float(text)
        if text.lower().lstrip("+-") in ("inf", "infinity", ".inf", "nan", ".nan"):
            return float(text.replace(".", "")) if text.lower() != ".nan" else math.nan
    return None


def coerce(value: Any, tp: Any, key: str, reporter: Reporter = CONFIG) -> Any:
    """``value`` checked against annotation ``tp``; ints and float spellings pass for floats."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            reporter.fail(key, f"expected a mapping, got {value!r}")
        return build(tp, value, key, reporter)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        # A mapping for ``Section | None`` is that section: its own errors are the ones to report.
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and len(sections) == 1:
            return coerce(value, sections[0], key, reporter)
        for arg in args:
            try:
                return coerce(value, arg, key, reporter)
            except ConfigError:
                continue
    elif origin is dict:
        if isinstance(value, dict):
            kt, vt = typing.get_args(tp) or (Any, Any)
            return {coerce(k, kt, f"{key}.{k}", reporter): coerce(v, vt, f"{key}.{k}", reporter)
                    for k, v in value.items()}
    elif origin in (list, tuple):
        if isinstance(value, list):
            inner = typing.get_args(tp)[0]
            items = [coerce(v, inner, f"{key}[{i}]", reporter) for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        f = as_float(value)
        if f is not None:
            return f
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    reporter.fail(key, f"expected {describe(tp)}, got {value!r}")


def build(cls: type, data: dict[str, Any], prefix: str = "", reporter: Reporter = CONFIG,
          extra: Callable[[str, Any, str], Any] | None = None) -> Any:
    """An instance of dataclass ``cls`` from ``data``, every key and value checked.

    ``extra(name, value, key)``: called for keys that are not fields (a config with open sections,
    such as the model config, whose constructor takes them as keywords); returns the built value
    or fails. Without it an unknown key fails listing the allowed ones.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]
    kwargs, rest = {}, {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k in names:
            kwargs[k] = coerce(v, hints[k], key, reporter)
        elif extra is not None:
            rest[k] = extra(str(k), v, key)
        else:
            reporter.unknown(key, names)
    return cls(**kwargs, **rest)


def fields_table(cls: type, prefix: str = "") -> list[tuple[str, str, Any]]:
    """``(key, type, default)`` of every field of ``cls``, nested dataclasses expanded."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(fields_table(tp, key))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = None
        rows.append((key, describe(tp), default))
    return rows
