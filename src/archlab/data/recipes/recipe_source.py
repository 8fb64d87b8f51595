"""A fetched recipe as a document source for ``prepare``: mixes, caps and the cleaned-text cache.

:func:`open_recipe` fetches everything a recipe needs first (so a failure leaves nothing
behind) and returns a :class:`RecipeSource`, which :func:`archlab.data.prepare.prepare` accepts
in place of a source spec and whose ``describe()`` records licence and provenance (package,
version, file, sha256, registry) in the manifest.

Byte caps (a mix component's cap, or ``max_bytes``/``--max-mb``) keep a deterministic sample of
whole documents: documents are ranked by ``sha256("archlab-recipe-sample:" + name)`` and taken
in that order while they fit, then yielded in their original order. Unlike a prefix, the sample
spreads over the whole source (all letters of a dictionary, all parts of a manual), and it does
not depend on the split seed. ``stdlib`` alone keeps the built-in source's prefix rule and its
default of 8 MB.

The first complete pass over a package's documents is saved in the cache as
``cleaned/<recipe>-<sha256[:16]>-<code>.jsonl``; later passes (``prepare`` reads its source
three times) and later runs read that file instead of cleaning again.

A recipe with ``dedup`` (``en-large``) drops every document whose normalized text (NFKC,
casefolded, whitespace squeezed) an earlier document of the mix already had, across all its
components: the first copy in mix order is kept. Packages repeat pages (licence texts, the same
page in two manuals, empty stubs that differ only in their title), and a repeated document could
land in both splits. The counts are recorded in the manifest's source entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import unicodedata
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from archlab.data.recipes import cleaners, fetch, specs
from archlab.data.recipes.cache import default_cache_dir, remove_stale
from archlab.data.recipes.cleaners import CLEANING_VERSION, Document
from archlab.data.recipes.fetch import ProgressFn
from archlab.data.recipes.specs import Component, Recipe, get_recipe
from archlab.data.decoding import text_bytes
from archlab.data.sources import open_source
from archlab.errors import DataError

SAMPLE_KEY = "archlab-recipe-sample:"
# Cached cleaned text is keyed by the source of the readers and of the recipe definitions, so
# any change to a reader, a cleaning rule or a recipe's members re-cleans.
CODE_HASH = hashlib.sha256(Path(cleaners.__file__).read_bytes()
                           + Path(specs.__file__).read_bytes()).hexdigest()[:12]


@dataclass
class RecipePart:
    """One component of a fetched recipe: where its files are and where they came from."""

    recipe: Recipe
    root: Path
    provenance: dict[str, Any]
    max_bytes: int | None  # the mix's cap for this component
    cleaned: Path | None = None  # where the cleaned documents are cached (None: not cached)


@dataclass
class RecipeSource:
    """A fetched recipe: its documents, in a fixed order, and the manifest's provenance.

    Behaves like :class:`archlab.data.sources.Source` for ``prepare``: ``spec``, ``path``,
    ``documents()`` and ``describe()`` (a list of manifest entries, one per component).
    """

    recipe: Recipe
    parts: list[RecipePart]
    max_bytes: int | None  # the overall cap (None: none)
    spec: str = ""
    path: str = ""
    _chosen: dict[int, set[str] | None] = field(default_factory=dict, repr=False)
    _overall: set[str] | None = field(default=None, repr=False)
    _overall_done: bool = field(default=False, repr=False)
    # per part: [documents dropped as duplicates, their bytes] (filled by the first full pass)
    _dups: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.spec = f"recipe:{self.recipe.name}"
        self.path = str(self.parts[0].root) if len(self.parts) == 1 else "(mix)"

    def documents(self) -> Iterator[Document]:
        """The documents of every part, in order, each part within its cap, all within the
        overall cap."""
        if self._prefix_rule():
            yield from open_source("stdlib", max_bytes=self.max_bytes or 0).documents()
            return
        if self.max_bytes is not None and not self._overall_done:
            self._overall = _sample(self._capped_parts(), self.max_bytes, f"recipe {self.recipe.name!r}")
            self._overall_done = True
        for name, text in self._capped_parts():
            if self._overall is None or name in self._overall:
                yield name, text

    def describe(self) -> list[dict[str, Any]]:
        """One manifest ``sources`` entry per component: what was read and where it came from."""
        entries = []
        for i, part in enumerate(self.parts):
            r = part.recipe
            entry: dict[str, Any] = {
                "spec": f"recipe:{r.name}",
                "fmt": "recipe",
                "path": str(part.root),
                "max_bytes": part.max_bytes,
                "recipe": r.name,
                "licence": r.licence,
                "cleaning": r.cleaning,
                "cleaning_version": CLEANING_VERSION,
                **part.provenance,
            }
            if self.recipe.is_mix:
                entry["mix"] = self.recipe.name
            if self.recipe.dedup:
                entry["dedup"] = "exact: sha256 of NFKC-casefolded, whitespace-squeezed text; first copy kept"
                if i in self._dups:
                    entry["duplicates_dropped"], entry["duplicate_bytes_dropped"] = self._dups[i]
            if r.package is None:
                entry["python"] = platform.python_version()
            entries.append(entry)
        for entry in entries:
            if self.max_bytes is not None:
                entry["mix_max_bytes" if self.recipe.is_mix else "max_bytes"] = self.max_bytes
            if self._prefix_rule():
                entry["cap_rule"] = "prefix, as the built-in stdlib source"
            elif entry["max_bytes"] is not None or self.max_bytes is not None:
                entry["cap_rule"] = ("whole documents in order of sha256('archlab-recipe-sample:' "
                                     "+ name) while they fit, kept in source order")
        return entries

    # -- internals --------------------------------------------------------------------------
    def _prefix_rule(self) -> bool:
        return not self.recipe.is_mix and self.recipe.package is None

    def _capped_parts(self) -> Iterator[Document]:
        seen: set[str] = set()
        texts: set[bytes] = set()
        dups: dict[int, list[int]] = {}
        for i, part in enumerate(self.parts):
            dups[i] = [0, 0]
            if part.max_bytes is not None and i not in self._chosen:
                self._chosen[i] = _sample(lambda p=part: _part_documents(p), part.max_bytes,
                                          f"component {part.recipe.name!r} of {self.recipe.name!r}")
            chosen = self._chosen.get(i)
            for name, text in _part_documents(part):
                if chosen is not None and name not in chosen:
                    continue
                if name in seen:
                    raise DataError(f"recipe {self.recipe.name!r}: two documents are named {name!r}")
                seen.add(name)
                if self.recipe.dedup:
                    key = text_key(text)
                    if key in texts:
                        dups[i][0] += 1
                        dups[i][1] += text_bytes(text)
                        continue
                    texts.add(key)
                yield name, text
        self._dups = dups  # reached only by a complete pass


def text_key(text: str) -> bytes:
    """What two documents must share to count as duplicates: their text after NFKC, casefolding
    and squeezing whitespace (so re-wrapped or re-indented copies match)."""
    norm = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return hashlib.sha256(norm.encode("utf-8")).digest()


def _part_documents(part: RecipePart) -> Iterator[Document]:
    """A part's non-empty documents; the first complete pass is saved as JSON lines in the cache
    (keyed by the package's sha256 and the readers' code) and later passes read that file."""
    if part.cleaned is not None and part.cleaned.is_file():
        yield from _read_cleaned(part.cleaned)
        return
    cache = _CleanedCache(part.cleaned) if part.cleaned is not None else None
    try:
        for name, text in part.recipe.documents(part.root):
            if not text:
                continue
            if cache is not None:
                cache.add(name, text)
            yield name, text
        if cache is not None:
            cache.finish()
    finally:
        if cache is not None:  # abandoned or failed: no partial cache entry
            cache.abandon()


class _CleanedCache:
    """A part's cleaned documents, written to a temporary beside ``path`` and renamed into place
    when complete. The cache only saves time, so it never raises: if it cannot be written (a full
    disk, a read-only cache folder), the documents still flow and the entry is just not made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".tmp-{uuid.uuid4().hex[:12]}-{path.name}")
        self.file: TextIO | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(path.parent)
            self.file = open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115 (closed by finish/abandon)
        except OSError:
            self.abandon()

    def add(self, name: str, text: str) -> None:
        if self.file is not None:
            try:
                self.file.write(json.dumps([name, text]) + "\n")
            except OSError:
                self.abandon()

    def finish(self) -> None:
        file, self.file = self.file, None
        if file is None:
            return
        try:
            file.close()
            os.replace(self.tmp, self.path)
        except OSError:
            self.abandon()

    def abandon(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            try:
                file.close()  # closes the descriptor even when the flush fails
            except OSError:
                pass
        try:
            self.tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _read_cleaned(path: Path) -> Iterator[Document]:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, text = json.loads(line)
                yield name, text
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read the cached cleaned text {path}: {e}; delete it") from None


def _sample(docs: Iterable[Document] | Callable[[], Iterable[Document]], max_bytes: int,
            what: str) -> set[str]:
    """Names of the whole documents kept under a cap: by ascending sample hash, while they fit."""
    stream = docs() if callable(docs) else docs
    ranked = []
    smallest = None
    for name, text in stream:
        n = text_bytes(text)
        smallest = n if smallest is None else min(smallest, n)
        ranked.append((hashlib.sha256((SAMPLE_KEY + name).encode()).digest(), name, n))
    ranked.sort()
    chosen: set[str] = set()
    used = 0
    for _, name, n in ranked:
        if used + n <= max_bytes:
            chosen.add(name)
            used += n
    if not chosen and ranked:
        raise DataError(f"a cap of {max_bytes:,} bytes keeps no whole document of {what} "
                        f"(its smallest document has {smallest:,} bytes); raise --max-mb")
    return chosen


def open_recipe(
    name: str,
    cache_dir: str | Path | None = None,
    max_bytes: int | None = None,
    any_version: bool = False,
    progress: ProgressFn | None = None,
) -> RecipeSource:
    """Fetch every package ``name`` needs and return its documents as a source for ``prepare``.

    ``max_bytes``: None is the recipe's default (8 MB for stdlib, no cap otherwise), 0 no cap.
    ``any_version``: if a pinned version has left the registry, take the version it offers now
    (recorded in the manifest) instead of failing.
    """
    recipe = get_recipe(name)
    if max_bytes is not None and max_bytes < 0:
        raise DataError(f"max_bytes must be >= 0 (0 = no limit), got {max_bytes}")
    cap = recipe.default_max_bytes if max_bytes is None else (max_bytes or None)
    components = recipe.components or (Component(recipe.name),)
    parts = []
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    for comp in components:
        sub = get_recipe(comp.recipe)
        root, provenance = fetch.fetch_recipe(sub, cache, any_version, progress)
        cleaned = None
        if sub.package is not None:
            cleaned = cache / "cleaned" / f"{sub.name}-{provenance['sha256'][:16]}-{CODE_HASH}.jsonl"
        parts.append(RecipePart(sub, root, provenance, comp.max_bytes, cleaned))
    return RecipeSource(recipe, parts, cap)

