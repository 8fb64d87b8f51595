"""``archlab data prepare`` and ``archlab data info``.

User mistakes raise ``DataError``; the main CLI prints its message as one line and exits
non-zero. Progress goes to stderr so that stdout holds only the summary.
"""

from __future__ import annotations

import argparse
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

from archlab.data.loader import TokenData
from archlab.data.prepare import DEFAULT_SHARD_TOKENS, SPLITS, prepare
from archlab.data.sources import FORMATS, STDLIB_DEFAULT_MAX_BYTES

DEFAULT_OUT = "data/stdlib"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``data`` command and its subcommands to the main parser."""
    data = subparsers.add_parser("data", help="prepare and inspect tokenized corpora",
                                 description="Tokenize a corpus into shards, or describe prepared data.")
    sub = data.add_subparsers(dest="data_command", required=True, metavar="{prepare,info}")

    p = sub.add_parser(
        "prepare", help="train a tokenizer and write token shards",
        description="Read a corpus, split its documents into train/val, train a byte-level BPE on "
                    "the train documents and write token shards plus a manifest.")
    p.add_argument("--source", default="stdlib",
                   help="`stdlib` (default), a file, a directory, a glob pattern (quote it), or "
                        "a Hugging Face hub dataset name (needs the `datasets` package)")
    p.add_argument("--format", dest="fmt", default="auto", choices=FORMATS,
                   help="how to read the source (default: inferred from suffix/layout)")
    p.add_argument("--field", default="text", help="text field of JSONL/Parquet/HF rows (default: text)")
    p.add_argument("--split", default="train",
                   help="split of a saved DatasetDict or a hub dataset (default: train)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default: 4096)")
    p.add_argument("--val-frac", type=float, default=0.02,
                   help="fraction of documents held out for validation (default: 0.02)")
    p.add_argument("--max-mb", type=float, default=None,
                   help=f"use only the first MB (10^6 bytes) of text; default "
                        f"{STDLIB_DEFAULT_MAX_BYTES // 10**6} for stdlib, everything otherwise; 0 = no limit")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default: 0)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help=f"tokens per shard file (default: {DEFAULT_SHARD_TOKENS:,})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared directory")
    p.set_defaults(func=run_prepare)

    i = sub.add_parser("info", help="summarize a prepared data directory",
                       description="Check a prepared data directory and print its manifest summary.")
    i.add_argument("dir", nargs="?", default=DEFAULT_OUT, help=f"data directory (default: {DEFAULT_OUT})")
    i.set_defaults(func=run_info)


def run_prepare(args: argparse.Namespace) -> int:
    max_bytes = None if args.max_mb is None else round(args.max_mb * 10**6)
    stderr = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description:<20}"), BarColumn(),
                  DownloadColumn(), TimeElapsedColumn(), console=stderr, transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def report(stage: str, done: int, total: int | None) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        manifest = prepare(args.source, args.out, vocab_size=args.vocab_size, fmt=args.fmt,
                           field=args.field, val_frac=args.val_frac, max_bytes=max_bytes,
                           seed=args.seed, shard_tokens=args.shard_tokens, split=args.split,
                           overwrite=args.overwrite, progress=report)
    console = Console()
    print_summary(console, Path(args.out), manifest)
    console.print(f"prepared {args.out} in {manifest['prepare_seconds']:.1f} s")
    return 0


def run_info(args: argparse.Namespace) -> int:
    data = TokenData(args.dir)  # validates manifest, shards and tokenizer hash
    print_summary(Console(), data.path, data.manifest)
    return 0


def print_summary(console: Console, path: Path, manifest: dict[str, Any]) -> None:
    """Sources, per-split sizes and the tokenizer of a manifest, as rich tables."""
    sources = Table(title=f"data {path}: sources", title_justify="left")
    for column in ("spec", "format", "path", "field / split", "limit", "python"):
        sources.add_column(column, overflow="fold")
    for src in manifest["sources"]:
        limit = src.get("max_bytes")
        sources.add_row(
            src["spec"], src["fmt"], src["path"],
            " / ".join(str(src[k]) for k in ("field", "split") if k in src) or "-",
            f"{limit / 10**6:g} MB" if limit else "none",
            src.get("python", "-"))
    console.print(sources)

    splits = Table(title="splits", title_justify="left")
    for column in ("split", "docs", "tokens", "bytes", "bytes/token", "shards"):
        splits.add_column(column, justify="left" if column == "split" else "right")
    for name in SPLITS:
        entry = manifest["splits"][name]
        splits.add_row(name, f"{entry['n_docs']:,}", f"{entry['n_tokens']:,}", f"{entry['n_bytes']:,}",
                       f"{entry['n_bytes'] / entry['n_tokens']:.3f}", str(len(entry["shards"])))
    console.print(splits)

    tok = manifest["tokenizer"]
    rule = manifest["split"]
    info = Table(show_header=False, title="tokenizer and split", title_justify="left")
    info.add_column("key")
    info.add_column("value", overflow="fold")
    info.add_row("tokenizer", f"{tok['kind']}, {tok['file']}, eos {tok['eos_token']} = {tok['eos_id']}")
    info.add_row("vocab size", f"{manifest['vocab_size']} (asked {manifest['vocab_size_requested']}), "
                               f"tokens stored as {manifest['dtype']}")
    info.add_row("tokenizer sha256", tok["sha256"])
    info.add_row("split", f"seed {rule['seed']}, val_frac {rule['val_frac']}, by document name hash")
    info.add_row("created", f"{manifest['created']} in {manifest['prepare_seconds']} s")
    console.print(info)
