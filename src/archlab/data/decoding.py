"""Bytes on disk to text, with every undecodable byte counted, and how text is measured in bytes.

A file read in the wrong encoding does not fail: its undecodable bytes become U+FFFD, so one
wrong guess (a Latin-1 folder read as UTF-8) silently changes the corpus and, since U+FFFD is
3 UTF-8 bytes, inflates the byte counts behind bits per byte. So sources decode through
:func:`decode`, which counts the bytes it replaced; the count goes to the manifest, the prepare
summary and a warning, and ``--encoding`` names the right codec.
"""

from __future__ import annotations

import codecs
import threading
from dataclasses import dataclass, field
from typing import Any

from archlab.errors import DataError

DEFAULT_ENCODING = "utf-8"
# How many file names a source's manifest entry lists as examples of replaced bytes.
_EXAMPLES = 5

# The ``errors=`` handler that replaces undecodable bytes with U+FFFD and counts them into a
# per-thread total; callers read it (replaced_so_far) before and after each decode call, which
# runs to completion without yielding, so interleaved generators (or other threads) never mix
# their counts.
REPLACE_AND_COUNT = "archlab-count-replace"
_counter = threading.local()


def _count_and_replace(err: UnicodeError) -> tuple[str, int]:
    if not isinstance(err, UnicodeDecodeError):
        raise err
    _counter.n = getattr(_counter, "n", 0) + (err.end - err.start)
    return "\ufffd", err.end


codecs.register_error(REPLACE_AND_COUNT, _count_and_replace)


def replaced_so_far() -> int:
    """This thread's running total of replaced bytes; a difference of two readings around a
    read is what that read replaced."""
    return int(getattr(_counter, "n", 0))


def decode(data: bytes, encoding: str) -> tuple[str, int]:
    """``data`` as text and the number of its bytes that did not decode (each run of them
    becomes one U+FFFD)."""
    before = replaced_so_far()
    text = data.decode(encoding, errors=REPLACE_AND_COUNT)
    return text, replaced_so_far() - before


def text_encoding(name: str) -> str:
    """The codec's canonical name (``latin-1`` -> ``iso8859-1``), or a one-line ``DataError``
    for a name Python does not know or a codec that does not turn bytes into text."""
    try:
        canonical = codecs.lookup(name).name
        b"ab".decode(canonical, "ignore")  # bytes-to-bytes codecs (base64, zlib) refuse this
    except LookupError:
        raise DataError(f"unknown text encoding {name!r} (--encoding); use a Python codec name "
                        "such as utf-8, latin-1 or cp1252") from None
    return canonical


def text_bytes(text: str) -> int:
    """The size of a document in bytes, as every count uses it: caps (``--max-mb``), progress,
    the manifest's ``n_bytes`` and hence bits per byte.

    It is the UTF-8 encoding of the decoded text, not the size of the file on disk. The byte-level
    tokenizer encodes exactly these bytes (its tokens decode back to them), so bits per byte
    measures the model on what it was given; and the same text counts the same whatever its file
    used: a Latin-1 ``é`` is 1 byte on disk and 2 here, a JSONL ``\\u00e9`` escape 6 on disk and
    2 here, a Parquet page compressed. Read in its right encoding (``--encoding``), a file loses
    nothing; bytes that did not decode count as U+FFFD (3 bytes each), and are reported.
    """
    return len(text.encode("utf-8"))


@dataclass
class DecodeTally:
    """Bytes replaced while decoding one pass over a source, in total and by file name."""

    replaced_bytes: int = 0
    files: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n_bytes: int) -> None:
        if n_bytes:
            self.replaced_bytes += n_bytes
            self.files[name] = self.files.get(name, 0) + n_bytes

    def describe(self, encoding: str) -> dict[str, Any]:
        """The manifest's record: the encoding, the replaced bytes, and a few files that had some."""
        info: dict[str, Any] = {"encoding": encoding, "replaced_bytes": self.replaced_bytes}
        if self.files:
            info["replaced_files"] = len(self.files)
            info["replaced_examples"] = sorted(self.files)[:_EXAMPLES]
        return info


def replacement_warning(entry: dict[str, Any]) -> str | None:
    """The one-line warning for a manifest ``sources`` entry whose text had undecodable bytes."""
    n = entry.get("replaced_bytes")
    if not n:
        return None
    examples = entry.get("replaced_examples") or ["?"]
    encoding = entry.get("encoding", DEFAULT_ENCODING)
    return (f"warning: {n:,} bytes of {entry['spec']} in {entry.get('replaced_files', 1):,} file(s) "
            f"(e.g. {examples[0]}) are not valid {encoding} and were replaced by U+FFFD; if the "
            "files use another encoding, prepare again with --encoding (e.g. latin-1 or cp1252) "
            "and --overwrite")
