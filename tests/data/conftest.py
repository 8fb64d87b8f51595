"""Fixtures for the data tests: real text only (the standard library's own files and docstrings).

The stdlib corpus is prepared once per session (300 KB, vocab 512, small shards so that the
train split has several) and treated as read-only; tests that damage a data directory copy it.
"""

from __future__ import annotations

import importlib
import inspect
import shutil
from pathlib import Path

import pytest

from archlab.data import prepare
from archlab.data.recipes import fetch
from tests.data.data_testutil import STDLIB_ARGS
from tests.data.recipes_testutil import FIX, FIXTURE_ROOT

# Modules whose docstrings are a few hundred bytes to a few KB of real English prose.
DOC_MODULES = ("argparse", "calendar", "collections", "csv", "difflib", "doctest", "heapq", "inspect",
               "json", "pickle", "random", "re", "sqlite3", "statistics", "string", "typing",
               "unittest")


@pytest.fixture(scope="session")
def stdlib_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "stdlib"
    prepare("stdlib", out, **STDLIB_ARGS)
    return out


@pytest.fixture(scope="session")
def real_docs() -> list[tuple[str, str]]:
    """(module name, module docstring) for a set of stdlib modules."""
    docs = []
    for name in DOC_MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        assert doc and len(doc) > 80, name
        docs.append((name, doc))
    return docs


@pytest.fixture
def data_copy(stdlib_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the prepared stdlib directory, safe to damage."""
    return Path(shutil.copytree(stdlib_dir, tmp_path / "copy"))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Recipes fetch the fixture folders instead of the registries; returns the packages asked for."""
    asked: list[str] = []

    def fake_fetch(pkg, cache_dir=None, any_version=False, progress=None):
        asked.append(pkg.name)
        return FIX / FIXTURE_ROOT[pkg.name], {
            "registry": "fixture", "package": pkg.name, "version": pkg.version, "file": pkg.filename,
            "sha256": pkg.sha256, "url": pkg.url}

    monkeypatch.setattr(fetch, "fetch_package", fake_fetch)
    return asked
