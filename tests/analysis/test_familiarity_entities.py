"""The entity set: the same seed writes the same file, another seed another; no fabricated name is
a real one; every domain has the same number of names of each kind, each inside its question."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from archlab.analysis.familiarity.entities import (DOMAINS, KINDS, MIN_FABRICATED_LEN, CharTrigrams, fabricate,
                                                   read_entities, source_names)
from archlab.errors import UsageError
from tests.helpers import run_cli


def write(capsys, path, seed: int, per_kind: int = 12) -> bytes:
    code, out, err = run_cli(capsys, "probe", "entities", "--out", str(path), "--seed", str(seed),
                             "--per-kind", str(per_kind))
    assert code == 0, err
    return path.read_bytes()


def test_same_seed_same_file_other_seed_other_file(tmp_path, capsys):
    first = write(capsys, tmp_path / "a.json", 3)
    assert write(capsys, tmp_path / "b.json", 3) == first
    assert write(capsys, tmp_path / "c.json", 4) != first


def test_balanced_and_fabricated_names_are_not_real(tmp_path, capsys):
    write(capsys, tmp_path / "e.json", 0)
    items = read_entities(tmp_path / "e.json")
    assert Counter((it["domain"], it["kind"]) for it in items) == {(d, k): 12 for d in DOMAINS for k in KINDS}
    for domain in DOMAINS:
        real = source_names(domain)
        every_real = {n.lower() for n in real["all"]}
        for it in items:
            if it["domain"] != domain:
                continue
            assert it["name"] in it["prompt"] and it["prompt"].endswith("?")
            if it["kind"] == "fabricated":
                assert it["name"].lower() not in every_real and len(it["name"]) >= MIN_FABRICATED_LEN
            else:
                assert it["name"] in real[it["kind"]]
        names = [it["name"] for it in items if it["domain"] == domain]
        assert len(set(names)) == len(names)
    # known and obscure names do not overlap in the sources themselves
    for domain in DOMAINS:
        real = source_names(domain)
        assert not set(real["known"]) & set(real["obscure"])


def test_fabricator_rejects_every_real_name():
    real = ["Tamarok", "Marotak", "Romatak", "Otamark"]
    out = fabricate(real, 5, random.Random(0))
    assert len(set(out)) == 5 and not {n.lower() for n in out} & {r.lower() for r in real}
    # the trigram model only emits characters and transitions it saw
    model = CharTrigrams(real)
    assert set(model.sample(random.Random(1), 20)) <= set("TMROamrotk")
    with pytest.raises(UsageError, match="could not fabricate"):
        fabricate(["Abcd"], 1, random.Random(0), max_tries=50)  # the only sample is the real name


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = run_cli(capsys, "probe", "entities", "--out", str(tmp_path / "x.json"), "--per-kind", "500")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--per-kind 500 is more than" in err
    code, out, err = run_cli(capsys, "probe", "entities", "--out", str(tmp_path / "x.json"), "--per-kind", "0")
    assert code == 2 and "must be at least 1" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"items": [{"domain": "city", "kind": "famous", "name": "Oslo", "prompt": "Oslo?"}]}')
    with pytest.raises(UsageError, match="item 0 needs"):
        read_entities(bad)


def test_city_rule_on_a_small_zone_tab(monkeypatch):
    from archlab.analysis.familiarity import entities

    text = "\n".join(["# comment line", "FR\t+4852+00220\tEurope/Paris", "BB\t+1306-05937\tAmerica/Barbados",
                      "US\t+404251-0740023\tAmerica/New_York\tEastern (most areas)",
                      "US\t+394606-0860929\tAmerica/Indiana/Indianapolis", "US\t+3757-08646\tAmerica/Indiana/Tell_City",
                      "US\t+415100-0873900\tAmerica/Chicago", "KZ\t+4315+07657\tAsia/Almaty",
                      "KZ\t+4431+05016\tAsia/Aqtau"])
    monkeypatch.setattr(entities, "zone_tab", lambda: (text, "test"))
    names = entities.city_names()
    # one-zone European country: known; one-zone American island: neither; a group's first zone and
    # a plain secondary zone of the US: neither; the group's later zone and Kazakhstan's secondary: obscure
    assert names["known"] == ["Paris"]
    assert names["obscure"] == ["Aqtau", "Tell City"]
    assert len(names["all"]) == 8 and "New York" in names["all"]
