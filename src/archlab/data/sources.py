"""Document sources: where a corpus lives and how to read it as ``(name, text)`` documents.

A source is chosen by a spec string: ``stdlib`` (the running interpreter's standard-library
source, always present offline), ``twohop`` or ``twohop:key=value,...`` (the two-hop benchmark's
corpus, generated from a seed by :mod:`archlab.data.twohop`), a local path (a file, a directory or
a glob pattern) read as text, JSONL, Parquet or a Hugging Face ``save_to_disk`` folder, or, when
the ``datasets`` package is installed and no such local path exists, a Hugging Face hub dataset
name.

Documents come out in a deterministic order (files sorted by relative path, rows in file order)
with names that are stable across machines (relative paths, ``file:line``, ``file:row``), because
the train/val split is decided by hashing the name: the same corpus must give the same split
wherever it is prepared.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import importlib.util
import json
import os
import platform
import re
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from archlab.data.arrow import save_to_disk_files
from archlab.data.decoding import (
    DEFAULT_ENCODING,
    REPLACE_AND_COUNT,
    DecodeTally,
    decode,
    replaced_so_far,
    text_encoding,
)
from archlab.errors import DataError

if TYPE_CHECKING:
    from archlab.data.twohop import TwoHopSource

Document = tuple[str, str]

FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
# Formats read from bytes, where --encoding applies; Parquet, Arrow and hub datasets hold text
# that is already decoded (Arrow strings are UTF-8 by definition).
DECODED_FORMATS = ("stdlib", "text", "jsonl")

# The default stdlib budget: about 8 MB keeps `archlab data prepare` well under a minute on two
# CPU cores while still giving a few million tokens.
STDLIB_DEFAULT_MAX_BYTES = 8_000_000

# Directories left out of the stdlib corpus. site-packages holds third-party code that differs
# between machines; the test suites (test, tests, idle_test) hold deliberately malformed and
# oddly encoded files and would make up more than half of the corpus; config-* holds
# build-machine scripts.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})

# Suffixes read from a directory in text mode. A fixed list rather than "anything that decodes"
# keeps binaries that happen to be valid UTF-8 (and data files such as .jsonl) out of the corpus.
TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".org", ".adoc",
    ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts",
    ".sh", ".html", ".htm", ".xml", ".css", ".toml", ".yaml", ".yml", ".cfg", ".ini",
})

_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")
_PARQUET_SUFFIXES = (".parquet",)
_ARROW_SUFFIXES = (".arrow",)

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GLOB_MAGIC = re.compile(r"[*?[]")


@dataclass(frozen=True)
class Source:
    """A resolved corpus: what was asked for, how it is read, and which files hold it.

    ``max_bytes`` (None: no limit) keeps the first ``max_bytes`` UTF-8 bytes of the document
    stream: whole documents in order, then the start of the one that crosses the limit (cut at a
    character boundary). A prefix, rather than a selection of documents that fit, keeps a limited
    corpus an easy-to-describe subset of the full one, and the budget is met whatever the sizes.

    ``encoding`` decodes text and JSONL files; bytes that do not decode become U+FFFD and are
    counted: ``decoding`` holds the count of the last complete pass over the documents, which
    ``describe()`` records.
    """

    spec: str
    fmt: str  # stdlib | text | jsonl | parquet | hf | hub
    field: str
    path: str  # the resolved location (absolute path, or the hub name)
    root: Path  # document names are relative to this folder
    files: tuple[Path, ...]
    split: str
    max_bytes: int | None
    encoding: str = DEFAULT_ENCODING
    decoding: DecodeTally = field(default_factory=DecodeTally, compare=False, repr=False)

    def documents(self) -> Iterator[Document]:
        """Yield the non-empty documents in order, up to the byte budget."""
        used = 0
        tally = DecodeTally()  # this pass's count; published only when the pass is complete
        for name, text in self._all_documents(tally):
            if not text:
                continue
            if self.max_bytes is not None:
                data = text.encode("utf-8")  # = decoding.text_bytes(text), with the bytes kept
                if used + len(data) > self.max_bytes:
                    head = data[: self.max_bytes - used].decode("utf-8", errors="ignore")
                    if head:
                        yield name, head
                    self._publish(tally)
                    return
                used += len(data)
            yield name, text
        self._publish(tally)

    def _publish(self, tally: DecodeTally) -> None:
        self.decoding.replaced_bytes, self.decoding.files = tally.replaced_bytes, tally.files

    def describe(self) -> dict[str, Any]:
        """The manifest entry: enough to find and re-read the same corpus."""
        info: dict[str, Any] = {
            "spec": self.spec,
            "fmt": self.fmt,
            "path": self.path,
            "max_bytes": self.max_bytes,
        }
        if self.fmt in ("jsonl", "parquet", "hf", "hub"):
            info["field"] = self.field
        if self.fmt in ("hf", "hub"):
            info["split"] = self.split
        if self.fmt == "stdlib":
            info["python"] = platform.python_version()
            info["excluded_dirs"] = [*sorted(_STDLIB_SKIP_DIRS), "config-*"]
        if self.fmt in DECODED_FORMATS:
            info.update(self.decoding.describe(self.encoding))
        return info

    def _all_documents(self, tally: DecodeTally) -> Iterator[Document]:
        if self.fmt == "hub":
            yield from _read_hub(self.path, self.split, self.field)
            return
        read = _READERS[self.fmt]
        for path in self.files:
            yield from read(path, _relative_name(path, self.root),
                            _ReadOptions(self.field, self.encoding, tally))


def open_source(
    spec: str,
    fmt: str = "auto",
    field: str = "text",
    split: str = "train",
    max_bytes: int | None = None,
    encoding: str = DEFAULT_ENCODING,
) -> Source | TwoHopSource:
    """Resolve ``spec`` into a :class:`Source`, checking that it exists and holds files (or, for
    ``twohop[:options]``, into the generated :class:`~archlab.data.twohop.TwoHopSource`).

    ``fmt="auto"`` infers the format: a directory with ``state.json`` or ``dataset_dict.json`` is
    a Hugging Face ``save_to_disk`` folder, any other directory is read as text files; a file (or
    every file a glob matches) by its suffix: ``.jsonl``/``.jsonl.gz`` JSONL, ``.parquet``
    Parquet, ``.arrow`` Arrow stream, anything else text. ``split`` picks the split of a saved
    DatasetDict or a hub dataset. ``max_bytes``: None is the source's default (8 MB for stdlib,
    no limit otherwise), 0 is no limit. ``encoding`` (a Python codec name) decodes text and
    JSONL files; other formats hold decoded text and take only the default.
    """
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; allowed: {', '.join(FORMATS)}")
    encoding = text_encoding(encoding)
    if spec.partition(":")[0] == "twohop":
        # Imported here, not at the top: the generator imports prepare, which imports this module.
        from archlab.data.twohop import open_twohop

        return open_twohop(spec, fmt=fmt, field=field, split=split, max_bytes=max_bytes, encoding=encoding)
    source = _resolve(spec, fmt, field, split, max_bytes)
    if encoding != DEFAULT_ENCODING:
        if source.fmt not in DECODED_FORMATS[1:]:
            what = "the stdlib source is Python files, which are UTF-8" if source.fmt == "stdlib" \
                else f"{source.fmt} data holds text that is already decoded"
            raise DataError(f"--encoding applies to text and JSONL files; {what} (got --encoding "
                            f"{encoding})")
        source = dataclasses.replace(source, encoding=encoding)
    return source


def _resolve(spec: str, fmt: str, field: str, split: str, max_bytes: int | None) -> Source:
    if max_bytes is not None and max_bytes < 0:
        raise DataError(f"max_bytes must be >= 0 (0 = no limit), got {max_bytes}")
    if not field:
        raise DataError("the field name (--field) must not be empty")
    limit = None if max_bytes == 0 else max_bytes

    if spec == "stdlib":
        if fmt != "auto":
            raise DataError(f"the stdlib source is Python files; it takes no --format (got {fmt!r})")
        root = Path(sysconfig.get_path("stdlib")).resolve()
        files = _walk(root, lambda name: name.endswith(".py") and not name.startswith("_sysconfigdata"),
                      lambda name: name in _STDLIB_SKIP_DIRS or name.startswith("config-"))
        if not files:
            raise DataError(f"no Python files found in the standard library at {root}")
        return Source(spec, "stdlib", field, str(root), root, tuple(files), split,
                      STDLIB_DEFAULT_MAX_BYTES if max_bytes is None else limit)

    path = Path(spec).expanduser()
    if path.is_dir():
        root = path.resolve()
        if fmt == "auto":
            fmt = "hf" if _is_hf_folder(root) else "text"
        if fmt == "hf":
            files = _hf_arrow_files(root, split)
        else:
            files = _walk(root, _suffix_filter(fmt), lambda name: name.startswith("."))
            if not files:
                raise DataError(f"directory {root} holds no {_describe_suffixes(fmt)} files")
        return Source(spec, fmt, field, str(root), root, tuple(files), split, limit)

    if path.is_file():
        resolved = path.resolve()
        if fmt == "auto":
            fmt = _format_of(resolved)
        return Source(spec, fmt, field, str(resolved), resolved.parent, (resolved,), split, limit)

    if _has_magic(spec):
        matches = sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(spec), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise DataError(f"no files match the pattern {spec!r}")
        if fmt == "auto":
            found = sorted({_format_of(p) for p in files})
            if len(found) > 1:
                raise DataError(f"the pattern {spec!r} matches files of several formats "
                                f"({', '.join(found)}); narrow it or pass --format")
            fmt = found[0]
        return Source(spec, fmt, field, spec, _glob_root(spec), tuple(files), split, limit)

    if fmt in ("auto", "hf") and _HUB_NAME.match(spec) and importlib.util.find_spec("datasets"):
        return Source(spec, "hub", field, spec, Path("."), (), split, limit)
    raise DataError(
        f"data source {spec!r} does not exist: it is not a file, a directory or a glob pattern "
        "that matches files (use `stdlib` for the built-in corpus; Hugging Face hub names need "
        "the `datasets` package)")


# --------------------------------------------------------------------------------------------
# Finding files
# --------------------------------------------------------------------------------------------
def _walk(root: Path, keep: Callable[[str], bool], skip_dir: Callable[[str], bool]) -> list[Path]:
    """Files under ``root`` whose name passes ``keep``, pruning directories early, sorted by
    relative path so the order does not depend on the file system."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        found.extend(Path(dirpath, f) for f in filenames if keep(f))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _suffix_filter(fmt: str) -> Callable[[str], bool]:
    if fmt == "jsonl":
        return lambda name: name.endswith(_JSONL_SUFFIXES)
    if fmt == "parquet":
        return lambda name: name.endswith(_PARQUET_SUFFIXES)
    return lambda name: not name.startswith(".") and Path(name).suffix.lower() in TEXT_SUFFIXES


def _describe_suffixes(fmt: str) -> str:
    if fmt == "jsonl":
        return "JSONL (" + ", ".join(_JSONL_SUFFIXES) + ")"
    if fmt == "parquet":
        return "Parquet (.parquet)"
    return "text (" + " ".join(sorted(TEXT_SUFFIXES)) + ")"


def _format_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(_ARROW_SUFFIXES):
        return "hf"
    return "text"


def _glob_root(pattern: str) -> Path:
    """The folder before the first wildcard: names of matched files are relative to it."""
    parts = Path(os.path.expanduser(pattern)).parts
    fixed = []
    for part in parts:
        if _has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed).resolve() if fixed else Path(".").resolve()


def _has_magic(pattern: str) -> bool:
    return _GLOB_MAGIC.search(pattern) is not None


def _relative_name(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


# --------------------------------------------------------------------------------------------
# Hugging Face save_to_disk folders
# --------------------------------------------------------------------------------------------
def _is_hf_folder(root: Path) -> bool:
    return (root / "state.json").is_file() or (root / "dataset_dict.json").is_file()


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None


def _hf_arrow_files(root: Path, split: str) -> list[Path]:
    """The Arrow files of a ``Dataset.save_to_disk`` folder, or of one split of a
    ``DatasetDict.save_to_disk`` folder, in the order ``state.json`` lists them."""
    if (root / "dataset_dict.json").is_file():
        splits = _load_json(root / "dataset_dict.json").get("splits", [])
        if split not in splits:
            raise DataError(f"{root} is a Hugging Face DatasetDict without the split {split!r}; "
                            f"its splits: {', '.join(map(str, splits)) or 'none'} (pass --split)")
        root = root / split
    if not (root / "state.json").is_file():
        raise DataError(f"{root} is not a Hugging Face save_to_disk folder: it has no state.json")
    return save_to_disk_files(root)


# --------------------------------------------------------------------------------------------
# Readers: (path, name, options) -> documents
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _ReadOptions:
    """What a reader needs besides the file: the text field, the encoding of text and JSONL
    files, and the tally their undecodable bytes are counted into."""

    field: str
    encoding: str
    tally: DecodeTally


def _read_text(path: Path, name: str, opts: _ReadOptions) -> Iterator[Document]:
    """One document per file; undecodable bytes become U+FFFD (counted) rather than failing the
    corpus. Universal newlines, as ``read_text`` had."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    text, replaced = decode(data, opts.encoding)
    opts.tally.add(name, replaced)
    yield name, text.replace("\r\n", "\n").replace("\r", "\n")


def _read_jsonl(path: Path, name: str, opts: _ReadOptions) -> Iterator[Document]:
    """One document per line (``.gz`` is decompressed); blank lines are skipped."""
    opener = gzip.open if path.name.endswith(".gz") else open
    field = opts.field
    try:
        with opener(path, "rt", encoding=opts.encoding, errors=REPLACE_AND_COUNT) as f:
            for lineno, line in enumerate(_counted_lines(f, name, opts.tally), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno} is not valid JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{lineno} is a JSON {type(record).__name__}, "
                                    "not an object with a text field")
                if field not in record:
                    fields = ", ".join(map(str, record)) or "none"
                    raise DataError(f"{path}:{lineno} has no field {field!r} (its fields: {fields}); "
                                    "pass --field")
                value = record[field]
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise DataError(f"{path}:{lineno}: field {field!r} holds a "
                                    f"{type(value).__name__}, not text")
                yield f"{name}:{lineno}", value
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {e}") from None


def _counted_lines(f: Any, name: str, tally: DecodeTally) -> Iterator[str]:
    """The lines of the text file ``f``, counting into ``tally`` the bytes its decoder replaced
    (measured around each read, which does not yield, so only this file's bytes count)."""
    while True:
        before = replaced_so_far()
        line = f.readline()
        tally.add(name, replaced_so_far() - before)
        if not line:
            return
        yield line


def _check_text_column(schema: pa.Schema, path: Path, field: str) -> None:
    if field not in schema.names:
        raise DataError(f"{path} has no column {field!r} (its columns: {', '.join(schema.names)}); "
                        "pass --field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {field!r} holds {kind}, not text")


def _rows(batches: Iterator[pa.RecordBatch], name: str, column: str) -> Iterator[Document]:
    row = 0
    for batch in batches:
        for value in batch.column(column).to_pylist():
            if value is not None:
                yield f"{name}:{row}", value
            row += 1


def _read_parquet(path: Path, name: str, opts: _ReadOptions) -> Iterator[Document]:
    field = opts.field
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path} is not a readable Parquet file: {e}") from None
    _check_text_column(pf.schema_arrow, path, field)
    yield from _rows(pf.iter_batches(columns=[field], batch_size=1024), name, field)


def _read_arrow(path: Path, name: str, opts: _ReadOptions) -> Iterator[Document]:
    """An Arrow IPC stream (what ``save_to_disk`` writes), or an Arrow IPC file."""
    field = opts.field
    try:
        source = pa.memory_map(str(path))
        try:
            reader: Any = pa.ipc.open_stream(source)
            batches: Iterator[pa.RecordBatch] = iter(reader)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path} is not a readable Arrow stream or file: {e}") from None
    _check_text_column(reader.schema, path, field)
    yield from _rows(batches, name, field)


def _read_hub(name: str, split: str, field: str) -> Iterator[Document]:
    """A Hugging Face hub dataset via ``datasets.load_dataset`` (downloaded and cached by it)."""
    import datasets  # optional: only present when the user installed it

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # the hub raises many kinds; all mean "could not load this name"
        raise DataError(f"could not load {name!r} (split {split!r}) from the Hugging Face hub, "
                        f"and no local path of that name exists: {e}") from None
    if field not in ds.column_names:
        raise DataError(f"hub dataset {name!r} has no column {field!r} (its columns: "
                        f"{', '.join(ds.column_names)}); pass --field")
    row = 0
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        for text in batch[field]:
            if isinstance(text, str):
                yield f"{split}:{row}", text
            elif text is not None:
                raise DataError(f"hub dataset {name!r}: column {field!r} holds "
                                f"{type(text).__name__}, not text")
            row += 1


_READERS: dict[str, Callable[[Path, str, _ReadOptions], Iterator[Document]]] = {
    "stdlib": _read_text,
    "text": _read_text,
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
    "hf": _read_arrow,
}
