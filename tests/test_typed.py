"""The one typed validator behind configs and suites (``archlab.typed``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from archlab.errors import ConfigError
from archlab.typed import as_float, build, merge


@dataclass
class Inner:
    lr: float = 1.0
    steps: int = 1


@dataclass
class Outer:
    inner: Inner | None = None
    table: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)


@pytest.mark.parametrize("text,value", [("3e-4", 3e-4), ("1E5", 1e5), (".5e-3", 5e-4), ("-2.5", -2.5),
                                        ("7", 7.0), ("+1e+2", 100.0),
                                        ("1_000e-6", 1e-3), ("2_5.0_5", 25.05)])
def test_float_spellings(text, value):
    assert as_float(text) == value
    assert build(Inner, {"lr": text}).lr == value


@pytest.mark.parametrize("bad", ["1e", "e5", "three", "1.2.3", "", "1__0", "_1e3", "1_e3", "1e3_"])
def test_not_floats(bad):
    assert as_float(bad) is None
    with pytest.raises(ConfigError, match="inner.lr: expected float"):
        build(Inner, {"lr": bad}, "inner")


def test_optional_section_reports_its_own_error():
    with pytest.raises(ConfigError, match=r"config error: outer.inner.steps: expected int, got 'x'"):
        build(Outer, {"inner": {"steps": "x"}}, "outer")
    assert build(Outer, {"inner": None}).inner is None
    assert build(Outer, {"inner": {"lr": "2e-3"}}).inner == Inner(lr=2e-3)


def test_mappings_and_lists_are_checked_per_entry():
    assert build(Outer, {"table": {"a": 1}, "names": ["x"]}).table == {"a": 1}
    with pytest.raises(ConfigError, match=r"outer.table.a: expected int"):
        build(Outer, {"table": {"a": "one"}}, "outer")
    with pytest.raises(ConfigError, match=r"outer.names\[1\]: expected str"):
        build(Outer, {"names": ["x", 2]}, "outer")


def test_unknown_key_lists_the_allowed():
    with pytest.raises(ConfigError, match=r"unknown key 'outer.tabel'; allowed here: inner, table, names"):
        build(Outer, {"tabel": {}}, "outer")


def test_merge_is_recursive_and_later_wins():
    assert merge({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": 3}, "d": {"e": 1}}) == {"a": {"b": 3, "c": 2},
                                                                                      "d": {"e": 1}}
