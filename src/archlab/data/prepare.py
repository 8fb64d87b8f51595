"""``prepare``: a corpus in, a directory of token shards, a tokenizer and a manifest out.

The corpus is read three times, so that memory stays bounded by one encoding batch whatever its
size: a scan cuts documents into chunks of at most ``CHUNK_BYTES`` (at blank lines) and decides
the train/val split of every chunk (see ``SPLIT_RULE``), a second pass trains the tokenizer on the
train text only (validation text stays unseen; skipped when ``--tokenizer`` reuses one), and a
third encodes every document piece (a run of consecutive chunks of one split) and appends it,
followed by ``<|endoftext|>``, to the shards of its split.

Output layout (``MANIFEST_FORMAT`` version ``MANIFEST_VERSION``)::

    manifest.json     what was prepared, from what, how it was split, shard sizes and hashes
    tokenizer.json    the byte-level BPE (its sha256 is in the manifest)
    train_000.bin ... raw little-endian uint16 (or uint32) token ids, read with np.memmap
    val_000.bin ...
    documents.jsonl   one line per document piece: split, offset in its split, tokens, bytes, name
                      (``file#3-7``: chunks 3 to 7 of that document)
    ...               files the source asks for (its ``side_files()``, e.g. a generated
                      benchmark's test items), listed in its manifest ``sources`` entry

Everything is built in a hidden sibling directory and renamed into place at the end, so a crash
or Ctrl-C never leaves a half-written data directory behind. A failed run removes that directory
(and nothing in its cleanup can raise over the error that stopped it); a killed run cannot, so
each prepare first removes the temporaries of processes that are gone (see "Temporaries"). A full
disk is one ``DataError`` line naming the path that could not be written.
"""

from __future__ import annotations

import array
import contextlib
import datetime as dt
import errno
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TextIO

import numpy as np

from archlab.data.decoding import DEFAULT_ENCODING, text_bytes
from archlab.data.sources import open_source
from archlab.data.tokenizer import (
    EOS_ID,
    EOS_TOKEN,
    TOKENIZER_FILE,
    file_sha256,
    find_tokenizer,
    load_reusable_tokenizer,
    save_tokenizer,
    train_bpe,
)
from archlab.errors import DataError
from archlab.io.temporaries import TEMPORARY, process_exists, temporary_path
from archlab.io.temporaries import host as this_host

MANIFEST_FILE = "manifest.json"
DOCUMENTS_FILE = "documents.jsonl"
MANIFEST_FORMAT = "archlab-tokens"
MANIFEST_VERSION = 1
SPLITS = ("train", "val")
DEFAULT_VOCAB_SIZE = 4096
# 100M tokens = 200 MB of uint16 per shard: large enough that few files exist, small enough to
# copy or compress one at a time.
DEFAULT_SHARD_TOKENS = 100_000_000
# Documents are encoded in batches of about this many characters: big enough for encode_batch to
# use every core, small enough to bound memory.
_ENCODE_BATCH_CHARS = 4 << 20
# Documents longer than this are cut into chunks of at most this many UTF-8 bytes (at blank
# lines, else line ends) before splitting: the split is decided per chunk, so a corpus of a few
# large files (novels, a single file) gets a validation split of the size asked for, instead of
# whole files (two novels and val_frac 0.02 gave 42% of the tokens to val). About a page of
# text: a 100 KB file still holds 25 chunks, and a val chunk is a few paragraphs of context.
CHUNK_BYTES = 4096
# A realised validation fraction (of the bytes) further than this factor from val_frac is an
# error, once the corpus holds enough chunks to expect it: with fewer than MIN_VAL_CHUNKS expected
# in val, chunks of unequal sizes (a 100-byte file beside a 4 KB one) can put the byte fraction
# anywhere, and the deviation is only noted.
SPLIT_TOLERANCE = 2.0
MIN_VAL_CHUNKS = 8
SPLIT_RULE = ("documents over chunk_bytes are cut into chunks of at most chunk_bytes UTF-8 bytes at "
              "blank lines (else line ends); numbering the chunks j = 0, 1, ... in corpus order, with "
              "v = int(sha256(f'{seed}:split')[:16], 16) / 2**64, chunk j is val if "
              "floor((j+1)*val_frac + v) > floor(j*val_frac + v), else train: every 1/val_frac-th "
              "chunk, so val holds floor or ceil of val_frac of the chunks; consecutive chunks of one "
              "split stay one document; if a split would be empty, chunk N//2 (for val) or 0 (for "
              "train) moves into it")

ProgressFn = Callable[[str, int, int | None], None]
"""``progress(stage, done_bytes, total_bytes or None)``, called as each stage advances."""


class DocumentSource(Protocol):
    """What ``prepare`` reads: a :class:`~archlab.data.sources.Source`, a
    :class:`~archlab.data.recipes.RecipeSource`, or any object like them. ``documents()`` is
    called once per pass (three times) and must give the same documents each time;
    ``describe()`` gives the manifest's ``sources`` entry, or a list of entries (a mix).
    Optionally, ``side_files()`` gives ``{file name: text}`` to write into the prepared directory
    (the two-hop source's test items, which must travel with the data they were held out of)."""

    spec: str
    path: str

    def documents(self) -> Iterator[tuple[str, str]]: ...

    def describe(self) -> dict[str, Any] | list[dict[str, Any]]: ...


def prepare(
    source: str | DocumentSource,
    out_dir: str | Path,
    vocab_size: int | None = None,
    fmt: str = "auto",
    field: str = "text",
    val_frac: float = 0.02,
    max_bytes: int | None = None,
    seed: int = 0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    split: str = "train",
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    encoding: str = DEFAULT_ENCODING,
    tokenizer: str | Path | None = None,
) -> dict[str, Any]:
    """Tokenize ``source`` into ``out_dir`` and return the manifest that was written.

    ``tokenizer``: reuse an existing tokenizer instead of training one (a prepared data
    directory, a run or checkpoint directory, or a ``tokenizer.json``; see
    :func:`archlab.data.tokenizer.find_tokenizer`), so that a model can be measured on a corpus
    it never saw; its file is copied byte for byte, so the data's tokenizer sha256 equals the
    checkpoint's. ``vocab_size`` (default 4096) applies only when a tokenizer is trained.

    ``source``/``fmt``/``field``/``split``/``max_bytes``/``encoding`` choose the corpus (see
    :func:`archlab.data.sources.open_source`; ``max_bytes=None`` means 8 MB for ``stdlib`` and
    everything otherwise, 0 means no limit). Bytes that do not decode in ``encoding`` are
    replaced and counted in the manifest's ``sources`` entry (``replaced_bytes``). ``seed`` and
    ``val_frac`` decide the document-level split. An ``out_dir`` that already holds prepared
    data is replaced only with ``overwrite=True``; a non-empty directory that is not prepared
    data is never touched. Leftover temporaries of dead prepare runs beside ``out_dir`` are
    removed first; a full disk is one ``DataError`` naming the path, with nothing left behind.

    ``source`` may also be a source object (see :class:`DocumentSource`), e.g. from
    :func:`archlab.data.recipes.open_recipe`; it carries its own format, limit and provenance,
    so ``fmt``/``field``/``split``/``max_bytes``/``encoding`` must then keep their defaults.
    """
    started = time.perf_counter()
    reuse: Path | None = None
    if tokenizer is not None:
        if vocab_size is not None:
            raise DataError("--vocab-size applies to a tokenizer trained here; a reused --tokenizer "
                            "keeps its own vocabulary")
        reuse = find_tokenizer(tokenizer)
        load_reusable_tokenizer(reuse)  # a wrong kind of tokenizer fails before any reading
    vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
    _check_args(vocab_size, val_frac, seed, shard_tokens)
    out = Path(out_dir)
    check_destination(out, overwrite)
    remove_stale_temporaries(out)  # a killed run's leftovers may be what fills the disk
    if isinstance(source, str):
        src: DocumentSource = open_source(source, fmt=fmt, field=field, split=split,
                                          max_bytes=max_bytes, encoding=encoding)
    else:
        if (fmt, field, split, max_bytes, encoding) != ("auto", "text", "train", None, DEFAULT_ENCODING):
            raise DataError("fmt, field, split, max_bytes and encoding apply to a source spec "
                            "string; a source object carries its own (set them when building it)")
        src = source
    report = progress or (lambda stage, done, total: None)

    with _full_disk_is_a_data_error(out):
        return _build(src, out, vocab_size, val_frac, seed, shard_tokens, report, started, reuse)


def _build(src: DocumentSource, out: Path, vocab_size: int, val_frac: float, seed: int,
           shard_tokens: int, report: ProgressFn, started: float, reuse: Path | None) -> dict[str, Any]:
    """The three passes: split, tokenizer (unless reused), shards in a temporary directory
    moved into place."""
    plan = _scan(src, seed, val_frac, report)
    if reuse is not None:
        tokenizer = load_reusable_tokenizer(reuse)
        vocab_size = tokenizer.get_vocab_size()
    else:
        tokenizer = train_bpe(
            (text for _, text, split in _pieces(_tracked(src, "training tokenizer", plan.total_bytes, report),
                                                plan)
             if split == "train"),
            vocab_size,
        )
    actual_vocab = tokenizer.get_vocab_size()
    dtype = np.dtype(np.uint16 if actual_vocab <= 1 << 16 else np.uint32)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out, "tmp")
    writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
    index: TextIO | None = None
    try:
        tmp.mkdir()  # not tempfile.mkdtemp: its 0700 mode would stick to the final directory
        if reuse is not None:
            with _naming(tmp / TOKENIZER_FILE):
                shutil.copyfile(reuse, tmp / TOKENIZER_FILE)  # the same bytes, so the same sha256
            tokenizer_sha = file_sha256(tmp / TOKENIZER_FILE)
        else:
            tokenizer_sha = save_tokenizer(tokenizer, tmp / TOKENIZER_FILE)
        _write_side_files(src, tmp)
        index = open(tmp / DOCUMENTS_FILE, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        with _naming(tmp / DOCUMENTS_FILE):
            for batch in _batches(_pieces(_tracked(src, "encoding", plan.total_bytes, report), plan)):
                encodings = tokenizer.encode_batch([text for _, text, _ in batch])
                for (name, text, split), enc in zip(batch, encodings, strict=True):
                    writer = writers[split]
                    ids = np.asarray([*enc.ids, EOS_ID], dtype=dtype)
                    n_bytes = text_bytes(text)  # UTF-8 of the decoded text: see text_bytes
                    index.write(json.dumps({"split": writer.split, "offset": writer.n_tokens,
                                            "n_tokens": len(ids), "n_bytes": n_bytes,
                                            "name": name}) + "\n")
                    writer.add(ids, n_bytes)
            index.close()
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "sources": _describe(src),
            "tokenizer": {"file": TOKENIZER_FILE, "sha256": tokenizer_sha, "kind": "byte-level BPE",
                          "eos_token": EOS_TOKEN, "eos_id": EOS_ID,
                          **({"reused_from": str(reuse.resolve())} if reuse is not None else {})},
            "vocab_size": actual_vocab,
            "vocab_size_requested": vocab_size,
            "dtype": dtype.name,
            "split": {"rule": SPLIT_RULE, "seed": seed, "val_frac": val_frac, "chunk_bytes": plan.chunk_bytes,
                      "val_frac_realised": round(plan.val_fraction(), 6), "val_chunks": plan.chunks["val"],
                      "train_chunks": plan.chunks["train"], **({"note": plan.note} if plan.note else {})},
            "splits": {s: w.close() for s, w in writers.items()},
            "documents": DOCUMENTS_FILE,
            "prepare_seconds": round(time.perf_counter() - started, 2),
        }
        with _naming(tmp / MANIFEST_FILE):
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _install(tmp, out)
    except BaseException:
        # Cleanup cannot fail, so the error reported is the one that stopped the run.
        _discard(tmp, writers, index)
        raise
    return manifest


def _discard(tmp: Path, writers: dict[str, ShardWriter], index: TextIO | None) -> None:
    """Close what is open and delete ``tmp``; never raises (a close that cannot flush on a full
    disk, a file already gone), so it cannot mask the error that made the run fail."""
    for writer in writers.values():
        writer.discard()
    if index is not None:
        try:
            index.close()
        except OSError:
            pass
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _full_disk_is_a_data_error(out: Path) -> Iterator[None]:
    """"No space left on device", wherever it happens while preparing ``out``, as one line:
    which path could not be written, and that the data already at ``out`` (if any) is untouched
    (the temporary directory is gone by then: see ``_discard``)."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        where = e.filename or out.parent  # every write in the build names its file (_naming)
        kept = (f"the prepared data already in {out} is unchanged"
                if (out / MANIFEST_FILE).is_file() else "nothing was written")
        raise DataError(f"no space left on device: writing {where} failed, its file system is "
                        f"full; free some space there (or choose another --out) and re-run "
                        f"`archlab data prepare`; {kept}") from None


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Add ``path`` to an OSError that names no file (a failed write or close does not)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def _write_side_files(src: DocumentSource, directory: Path) -> None:
    """The source's own files (``side_files()``, if it has any), beside the shards."""
    files: dict[str, str] = getattr(src, "side_files", dict)()
    for name, text in files.items():
        # A bug, not a user error: a source must not clobber what prepare writes or leave the folder.
        if name in (MANIFEST_FILE, TOKENIZER_FILE, DOCUMENTS_FILE) or Path(name).name != name \
                or name.endswith(".bin"):
            raise ValueError(f"a source's side file may not be named {name!r}")
        with _naming(directory / name):
            (directory / name).write_text(text, encoding="utf-8")


def _describe(src: DocumentSource) -> list[dict[str, Any]]:
    info = src.describe()
    return info if isinstance(info, list) else [info]


def _check_args(vocab_size: int, val_frac: float, seed: int, shard_tokens: int) -> None:
    if not 0.0 < val_frac < 1.0:
        raise DataError(f"val_frac (--val-frac) must be between 0 and 1 (exclusive), got {val_frac}")
    if seed < 0:
        raise DataError(f"the split seed (--seed) must be >= 0, got {seed}")
    if shard_tokens <= 0:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}")
    if vocab_size > 1 << 32:
        raise DataError(f"vocab size {vocab_size} does not fit in uint32 token ids")


def check_destination(out: Path, overwrite: bool) -> None:
    """Fail before any work if ``out`` cannot be (re)placed; never delete foreign files."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"output path {out} exists and is not a directory")
    if (out / MANIFEST_FILE).is_file():
        if not overwrite:
            raise DataError(f"{out} already holds prepared data; pass --overwrite to replace it "
                            "or choose another --out")
        return
    if any(out.iterdir()):
        raise DataError(f"{out} exists, is not empty and holds no {MANIFEST_FILE} (it is not "
                        "prepared data); refusing to replace it: choose another --out or empty it")


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` into place; an existing ``out`` is swapped out first.

    Two renames on one file system: readers see either the old or the new directory complete
    (for an instant neither), never a mixture.
    """
    if out.exists() and any(out.iterdir()):
        old = temporary_path(out, "old")
        os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)  # rename(2) replaces an empty directory atomically


# --------------------------------------------------------------------------------------------
# Temporaries
# --------------------------------------------------------------------------------------------
# A run builds in ``.NAME.tmp-HOST-PID-XXXXXXXX`` beside ``NAME`` and, when replacing data, parks
# the old directory as ``.NAME.old-HOST-PID-XXXXXXXX`` for an instant. A run that is killed
# (SIGKILL, out of memory, power loss) cannot remove them, and on a full disk they keep it full,
# so every prepare first removes those whose process is gone. Host and pid in the name tell a
# dead run from a live one; a directory from another host (a shared file system) is left alone.
# The name format and the liveness test are ``archlab.io.temporaries``'s, shared with checkpoints.
# Before names carried a pid, temporaries were ``.NAME.tmp-XXXXXXXX``: removed once this old.
_LEGACY_STALE_S = 6 * 3600


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the prepare temporaries beside ``out`` that no running process owns; return them.

    Build directories (``.tmp-``) of dead processes on this host go, for any output name in the
    folder; a parked old directory (``.old-``) only when its data directory is complete again
    (otherwise it may be the only copy). Never raises: a directory that cannot be removed stays.
    """
    removed: list[Path] = []
    try:
        entries = list(out.parent.iterdir()) if out.parent.is_dir() else []
    except OSError:
        return removed
    host = this_host()
    legacy = re.compile(rf"^\.{re.escape(out.name)}\.tmp-[0-9a-f]{{8}}$")
    for path in entries:
        m = TEMPORARY.match(path.name)
        try:
            if not path.is_dir() or path.is_symlink():
                continue
            if m is not None:
                if m["host"] != host or process_exists(int(m["pid"])):
                    continue
                if m["kind"] == "old" and not (out.parent / m["name"] / MANIFEST_FILE).is_file():
                    continue
            elif not (legacy.match(path.name) and time.time() - path.stat().st_mtime > _LEGACY_STALE_S):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


# --------------------------------------------------------------------------------------------
# The split
# --------------------------------------------------------------------------------------------
def split_hash(seed: int, name: str) -> float:
    """A number in [0, 1) fixed by (seed, name): the phase of the split (name "split")."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def chunk_text(text: str, limit: int = CHUNK_BYTES) -> list[str]:
    """``text`` cut into pieces of at most ``limit`` UTF-8 bytes whose concatenation is ``text``.

    Pieces end at paragraph boundaries (after a blank line) where they can; a paragraph longer
    than ``limit`` is cut after line ends, and a line longer than that between characters.
    Whole paragraphs are packed greedily, so pieces are close to ``limit``.
    """
    if len(text.encode("utf-8")) <= limit:
        return [text]
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for unit in _units(text, limit):
        n = len(unit.encode("utf-8"))
        if current and size + n > limit:
            chunks.append("".join(current))
            current, size = [], 0
        current.append(unit)
        size += n
    if current:
        chunks.append("".join(current))
    return chunks


def _units(text: str, limit: int) -> Iterator[str]:
    """Paragraphs (with their trailing blank lines), else lines, else slices, each <= limit bytes."""
    for paragraph in re.findall(r".*?\n(?:[ \t]*\n)+|.+", text, flags=re.S):
        if len(paragraph.encode("utf-8")) <= limit:
            if paragraph:
                yield paragraph
            continue
        for line in paragraph.splitlines(keepends=True):
            if len(line.encode("utf-8")) <= limit:
                yield line
                continue
            step = max(1, limit // 4)  # a character is at most 4 UTF-8 bytes
            for i in range(0, len(line), step):
                yield line[i:i + step]


@dataclass
class _SplitPlan:
    """The split of every chunk: the systematic rule plus the chunk moved to fill an empty split."""

    seed: int
    val_frac: float
    chunk_bytes: int = CHUNK_BYTES
    total_bytes: int = 0
    forced: dict[int, str] = field(default_factory=dict)
    split_bytes: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    chunks: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    note: str | None = None

    def __post_init__(self) -> None:
        self._phase = split_hash(self.seed, "split")

    def split_of(self, index: int) -> str:
        """The split of chunk ``index`` (counted from the start of the corpus).

        A systematic sample rather than a coin per chunk: every ``1/val_frac``-th chunk, at a
        phase set by the seed, so val gets floor or ceil of ``val_frac`` of the chunks whatever
        the corpus, spread evenly over it (independent coins left a 600 KB corpus with 1 val
        chunk where 3.4 were expected). A chunk's split depends only on its position, so a
        longer prefix of a corpus (``--max-mb``) keeps the split of a shorter one.
        """
        if index in self.forced:
            return self.forced[index]
        f, v = self.val_frac, self._phase
        return "val" if math.floor((index + 1) * f + v) > math.floor(index * f + v) else "train"

    def val_fraction(self) -> float:
        return self.split_bytes["val"] / max(1, self.total_bytes)


def _pieces(docs: Iterator[tuple[str, str]], plan: _SplitPlan) -> Iterator[tuple[str, str, str]]:
    """``(name, text, split)`` of each document, cut into chunks and split by ``plan``; the
    consecutive chunks of one split are joined again, so a document with no val chunk stays
    whole and the training text is cut only where validation text was taken out."""
    first = 0  # the corpus-wide number of the document's first chunk
    for name, text in docs:
        chunks = chunk_text(text, plan.chunk_bytes)
        splits = [plan.split_of(first + i) for i in range(len(chunks))]
        first += len(chunks)
        start = 0
        for i in range(1, len(chunks) + 1):
            if i == len(chunks) or splits[i] != splits[start]:
                piece = name if (start, i) == (0, len(chunks)) else f"{name}#{start}-{i - 1}"
                yield piece, "".join(chunks[start:i]), splits[start]
                start = i


def _scan(src: DocumentSource, seed: int, val_frac: float, report: ProgressFn) -> _SplitPlan:
    """Read the corpus once: size it, make sure both splits get at least one chunk, and check
    that the validation split is near the fraction asked for."""
    plan = _SplitPlan(seed, val_frac)
    sizes = array.array("q")  # bytes of every chunk, for the one that may move
    for _, text in src.documents():
        for chunk in chunk_text(text, plan.chunk_bytes):
            n = text_bytes(chunk)
            split = plan.split_of(len(sizes))
            plan.chunks[split] += 1
            plan.split_bytes[split] += n
            plan.total_bytes += n
            sizes.append(n)
        report("reading", plan.total_bytes, None)
    if len(sizes) < 2:
        raise DataError(f"data source {src.spec!r} ({src.path}) has {len(sizes)} non-empty document "
                        f"chunk(s) of up to {plan.chunk_bytes} bytes; at least 2 are needed (one for "
                        "train, one for val)")
    for split, index in (("val", len(sizes) // 2), ("train", 0)):
        if plan.chunks[split] == 0:
            other = "train" if split == "val" else "val"
            plan.forced[index] = split
            plan.chunks[split], plan.chunks[other] = 1, plan.chunks[other] - 1
            plan.split_bytes[split] += sizes[index]
            plan.split_bytes[other] -= sizes[index]
    _check_fraction(plan, src)
    return plan


def _check_fraction(plan: _SplitPlan, src: DocumentSource) -> None:
    """A validation split more than SPLIT_TOLERANCE times off val_frac is an error; in a corpus
    too small to expect MIN_VAL_CHUNKS val chunks it is only noted."""
    got, asked = plan.val_fraction(), plan.val_frac
    if asked / SPLIT_TOLERANCE <= got <= asked * SPLIT_TOLERANCE:
        return
    n_chunks = plan.chunks["train"] + plan.chunks["val"]
    what = (f"the validation split is {got:.2%} of the text of {src.spec!r} ({plan.chunks['val']} of "
            f"{n_chunks} chunks of up to {plan.chunk_bytes} bytes), more than {SPLIT_TOLERANCE:g}x from "
            f"--val-frac {asked:g}")
    if n_chunks * asked < MIN_VAL_CHUNKS:
        plan.note = (f"{what}: the corpus is too small (fewer than {MIN_VAL_CHUNKS} val chunks "
                     "expected) for the split to follow the fraction")
        return
    raise DataError(f"{what}; another --seed or a --val-frac nearer {got:.3g} gives an honest split "
                    "(the chunks that fell to val are much smaller or larger than the rest)")


def _tracked(src: DocumentSource, stage: str, total: int, report: ProgressFn) -> Iterator[tuple[str, str]]:
    done = 0
    for name, text in src.documents():
        yield name, text
        done += text_bytes(text)
        report(stage, done, total)


def _batches(docs: Iterator[tuple[str, str, str]]) -> Iterator[list[tuple[str, str, str]]]:
    batch: list[tuple[str, str, str]] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[1])
        if size >= _ENCODE_BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------
def open_shard(path: Path) -> BinaryIO:
    """A new shard file, open for writing (tests replace it to simulate a full disk)."""
    return open(path, "wb")  # noqa: SIM115 (the writer closes it per shard)


class ShardWriter:
    """Appends token arrays to ``{split}_000.bin``, ``{split}_001.bin``, ... of ``shard_tokens``
    tokens each (the last one shorter), hashing each shard as it is written."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory = directory
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.n_tokens = 0
        self.n_bytes = 0
        self.n_docs = 0
        self.shards: list[dict[str, Any]] = []
        self._file: BinaryIO | None = None
        self._path = directory
        self._hash = hashlib.sha256()
        self._in_shard = 0

    def add(self, ids: np.ndarray, n_bytes: int) -> None:
        self.n_docs += 1
        self.n_bytes += n_bytes
        while ids.size:
            if self._file is None:
                name = f"{self.split}_{len(self.shards):03d}.bin"
                self._path = self.directory / name
                self._file = open_shard(self._path)
                self.shards.append({"file": name})
            take = ids[: self.shard_tokens - self._in_shard]
            data = take.tobytes()
            with _naming(self._path):
                self._file.write(data)
            self._hash.update(data)
            self._in_shard += take.size
            self.n_tokens += take.size
            ids = ids[take.size:]
            if self._in_shard == self.shard_tokens:
                self._finish_shard()

    def close(self) -> dict[str, Any]:
        """Finish the last shard and return this split's manifest entry."""
        if self._file is not None:
            self._finish_shard()
        return {"shards": self.shards, "n_docs": self.n_docs, "n_tokens": self.n_tokens,
                "n_bytes": self.n_bytes}

    def discard(self) -> None:
        """Close an open shard without recording it (the caller deletes the directory). Never
        raises: on a full disk the close cannot flush, and that must not hide the first error."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()  # a buffered file closes its descriptor even when the flush fails
            except OSError:
                pass

    def _finish_shard(self) -> None:
        assert self._file is not None
        with _naming(self._path):
            self._file.close()
        self.shards[-1].update(n_tokens=self._in_shard, sha256=self._hash.hexdigest())
        self._file, self._hash, self._in_shard = None, hashlib.sha256(), 0
