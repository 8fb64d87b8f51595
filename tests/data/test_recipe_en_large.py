"""en-large: its new readers (plain dictd, POD, HTML manuals), exact-duplicate removal across the
mix and a document-level split with no document (or copy of one) in both splits, on the fixture
folders (real excerpts of the pinned packages, see fixtures/recipes/README.md); nothing is
downloaded: the `offline` fixture serves the folders in place of the registries."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest

from archlab.data.prepare import CHUNK_BYTES, prepare
from archlab.data.recipes import RECIPES, Component, Recipe, open_recipe
from archlab.data.recipes.cleaners import clean_dict_entry, clean_pod, read_dict_plain, read_html_pages
from archlab.data.recipes.recipe_source import text_key
from archlab.data.recipes.specs import EN_LARGE
from tests.data.recipes_testutil import FIX, recipe_docs

NEW = {"foldoc": "foldoc", "jargon": "jargon", "devil": "devil", "perl-doc": "perl-doc",
       "postgresql-doc": "postgresql-doc", "debian-handbook": "debian-handbook", "gnucash-docs": "gnucash-docs",
       "gimp-help": "gimp-help", "qt5-doc": "qt5-doc", "erlang-doc": "erlang-doc", "racket-doc": "racket-doc",
       "openjdk-doc": "openjdk-doc", "rust-books": "rust-books", "ghc-users-guide": "ghc-users-guide",
       "sklearn-doc": "sklearn-doc", "scipy-doc": "scipy-doc", "django-doc": "django-doc", "sqlite-doc": "sqlite-doc",
       "nodejs-doc": "nodejs-doc", "octave-doc": "octave-doc", "git-doc": "git-doc"}

TAG = re.compile(r"</?(?:div|span|p|a|pre|code|li|ul|ol|table|td|tr|th|script|style|nav|h[1-6])\b[^<>]*>")


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------
def test_each_new_recipe_reads_its_fixture() -> None:
    for recipe, folder in NEW.items():
        docs = recipe_docs(recipe, folder)
        assert docs and all(n.startswith(recipe + "/") and t.strip() for n, t in docs), recipe
        assert RECIPES[recipe].licence and RECIPES[recipe].package is not None
        if recipe not in ("perl-doc", "foldoc", "jargon", "devil"):
            assert not any(TAG.search(t) or "&amp;" in t for _, t in docs), recipe  # no markup left


def test_html_pages_skip_indexes_translations_and_listings() -> None:
    # the Portuguese GnuCash guide, Qt's member list and javadoc's class-use page are in the
    # fixtures and must be left out
    assert [n for n, _ in recipe_docs("gnucash-docs", "gnucash-docs")] == [
        "gnucash-docs/gnucash-guide-en/accts-oa1.html"]
    assert [n for n, _ in recipe_docs("qt5-doc", "qt5-doc")] == ["qt5-doc/qmake/qmake-manual.html"]
    assert [n for n, _ in recipe_docs("openjdk-doc", "openjdk-doc")] == [
        "openjdk-doc/java.base/java/lang/Override.html"]
    (_, erlang), = recipe_docs("erlang-doc", "erlang-doc")
    assert erlang.startswith("2 Error Logging\n\n2.1 Error Information")  # title anchors and top bar gone
    (_, racket), = recipe_docs("racket-doc", "racket-doc")
    assert racket.startswith("21.3 Creating Stand-Alone Executables") and "Welcome to Racket" not in racket
    # <pre> blocks (code) are left out by default, kept on request
    root = FIX / "python-doc"
    base = "usr/share/doc/python3.11/html"
    prose = dict(read_html_pages(root, "p", base, skip=r"genindex"))["p/library/heapq.html"]
    full = dict(read_html_pages(root, "p", base, skip=r"genindex", drop_pre=False))["p/library/heapq.html"]
    assert len(prose) < len(full) and "heapsort" in prose


def test_pod_keeps_prose_and_drops_code() -> None:
    (_, text), = recipe_docs("perl-doc", "perl-doc")
    assert text.startswith("NAME\n\nperlintro - a brief introduction and overview of Perl\n\nDESCRIPTION")
    assert "#!/usr/bin/env perl" not in text and "perl progname.pl" not in text  # verbatim examples
    assert "C<" not in text and "L<" not in text and "=head" not in text
    assert clean_pod("=head1 Use B<bold> and C<< $a <=> $b >>\n\nSee L<the FAQ|perlfaq> E<gt> X<idx>here.\n\n"
                     "    print 1;\n\n=begin html\n\n<b>x</b>\n\n=end html\n\n=cut\n") == \
        "Use bold and $a <=> $b\n\nSee the FAQ > here."


def test_plain_dictd_entries() -> None:
    (_, foldoc), = recipe_docs("foldoc", "foldoc")
    assert "{" not in foldoc and "ACT ONE\n\n<language, specification> A specification language." in foldoc
    # FOLDOC's overflowing lines are joined back into their paragraph
    assert "each instruction has an operand that is the number before it in memory." in foldoc
    (_, devil), = recipe_docs("devil", "devil")
    assert devil.startswith("FICKLENESS, n. The iterated satiety of an enterprising affection.")
    assert devil.split("\n")[5] == 'To Rome said Nero: "If to smoke you turn'  # verse keeps its lines
    assert clean_dict_entry("  a {b}\n  c\n\n  d", unwrap=True) == "a b c\n\nd"


# --------------------------------------------------------------------------------------------
# The mix: dedup and split
# --------------------------------------------------------------------------------------------
def test_dedup_drops_later_copies_across_components(offline: list[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Real copies: FOLDOC read again without unwrapping (the same entries, other line breaks) and
    # the Python docs read again by the generic HTML reader (the same page text).
    foldoc = RECIPES["foldoc"]
    monkeypatch.setitem(RECIPES, "foldoc-raw", Recipe(
        name="foldoc-raw", description="", licence="", approx_mb=0, package=foldoc.package,
        reader=partial(read_dict_plain, db="foldoc", prefix="foldoc-raw")))
    monkeypatch.setitem(RECIPES, "pydoc-copy", Recipe(
        name="pydoc-copy", description="", licence="", approx_mb=0, package=RECIPES["python-doc"].package,
        reader=partial(read_html_pages, prefix="pydoc-copy", base="usr/share/doc/python3.11/html",
                       skip=r"genindex", drop_pre=False)))
    parts = ("foldoc", "python-doc", "foldoc-raw", "pydoc-copy", "devil")
    for dedup in (False, True):
        monkeypatch.setitem(RECIPES, "dup-mix", Recipe(
            name="dup-mix", description="", licence="", approx_mb=0,
            components=tuple(Component(p) for p in parts), dedup=dedup))
        src = open_recipe("dup-mix", cache_dir=tmp_path)
        docs = list(src.documents())
        if not dedup:
            assert len({text_key(t) for _, t in docs}) < len(docs)  # the copies are there
            raw = dict(docs)["foldoc-raw/00000 *brainfuck"]
            assert raw != dict(docs)["foldoc/00000 *brainfuck"]  # though not byte-identical
    assert [n for n, _ in docs] == ["foldoc/00000 *brainfuck", "python-doc/library/heapq.html",
                                    "devil/00000 fickleness"]
    entries = {e["recipe"]: e for e in src.describe()}
    assert entries["foldoc-raw"]["duplicates_dropped"] == 1 and entries["pydoc-copy"]["duplicates_dropped"] == 1
    assert entries["foldoc"]["duplicates_dropped"] == 0 and entries["foldoc-raw"]["duplicate_bytes_dropped"] > 0
    assert list(src.documents()) == docs  # later passes (prepare reads three times) agree


def test_en_large_prepares_with_a_document_split(offline: list[str], tmp_path: Path) -> None:
    src = open_recipe("en-large", cache_dir=tmp_path / "cache")
    assert [p.recipe.name for p in src.parts] == list(EN_LARGE) and src.recipe.dedup
    texts = dict(src.documents())
    assert len({text_key(t) for t in texts.values()}) == len(texts)  # no exact duplicates
    out = tmp_path / "en-large"
    prepare(src, out, vocab_size=400, val_frac=0.25, seed=0)
    rows = [json.loads(line) for line in (out / "documents.jsonl").read_text().splitlines()]
    split = {r["name"]: r["split"] for r in rows}
    assert len(split) == len(rows)  # each piece once, in one split
    # prepare cuts documents longer than CHUNK_BYTES into paragraph-aligned pieces NAME#a-b
    # before the split (data/prepare.py); a document that fits one chunk is never cut, so it
    # lies wholly in one split, and no deduplicated text can reach both splits through a copy
    source = {name.split("#")[0] for name in split}
    assert source == set(texts)
    for name, text in texts.items():
        if len(text.encode()) <= CHUNK_BYTES:
            assert name in split
    assert {"train", "val"} == set(split.values())
    whole = {n for n in split if "#" not in n}
    val_keys = {text_key(texts[n]) for n in whole if split[n] == "val"}
    assert not val_keys & {text_key(texts[n]) for n in whole if split[n] == "train"}
    manifest = json.loads((out / "manifest.json").read_text())
    sources = manifest["sources"]
    assert [s["recipe"] for s in sources] == list(EN_LARGE)
    assert all(s["licence"] and s["sha256"] and "duplicates_dropped" in s for s in sources)
    assert manifest["split"]["seed"] == 0
