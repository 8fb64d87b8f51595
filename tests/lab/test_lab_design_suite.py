"""Suite-file side of the paired design: ``seeds.variants: baseline``, ``eval.adjust``, and run ids
that do not move for suites written before these keys existed."""

from __future__ import annotations

from pathlib import Path

import pytest

from archlab.errors import ConfigError
from archlab.lab.plan import build_plan
from archlab.lab.suite import load_suite, parse_suite
from tests.lab.lab_fakes import SUITE_YAML, fake_costs, write_suite


def parse(extra: dict) -> object:
    return parse_suite({"budget": {"tokens": 4096}, **extra}, origin="s.yaml", default_name="s")


def _ids(tmp_path: Path, sub: str, text: str) -> list[tuple[str, int, int, str]]:
    """The plan's runs of ``text`` written as fake.yaml in its own folder (same suite name)."""
    (tmp_path / sub).mkdir()
    plan = build_plan(load_suite(write_suite(tmp_path / sub, text, "fake.yaml")), tmp_path / "o",
                      costs_fn=fake_costs)
    return [(r.label, r.init_seed, r.data_seed, r.run_id) for r in plan.runs]


def test_variants_baseline_is_the_baseline_seeds_with_the_same_run_ids(tmp_path: Path) -> None:
    explicit = SUITE_YAML.replace("seeds: {baseline: [0, 1, 2], variants: [0, 1]}",
                                  "seeds: {baseline: [0, 1, 2], variants: [0, 1, 2], data: init}")
    named = SUITE_YAML.replace("seeds: {baseline: [0, 1, 2], variants: [0, 1]}",
                               "seeds: {baseline: [0, 1, 2], variants: baseline, data: init}")
    runs = _ids(tmp_path, "a", named)
    assert runs == _ids(tmp_path, "b", explicit)
    assert [r[:3] for r in runs] == [(label, s, s) for s in (0, 1, 2) for label in ("llama", "lower-init", "same")]


def test_new_keys_leave_run_ids_alone(tmp_path: Path) -> None:
    """Run ids hash (suite, label, init seed, data seed, config hash): eval.adjust and eval_data
    are in none of them, so adding them to a suite with results keeps every id (and result)."""
    with_keys = (SUITE_YAML.replace("eval: {last_k: 1}", "eval: {last_k: 1, adjust: holm}")
                 + "eval_data: {wiki: /somewhere/wiki}\n")
    assert _ids(tmp_path, "a", SUITE_YAML) == _ids(tmp_path, "b", with_keys)


def test_seed_and_adjust_keys_are_checked() -> None:
    s = parse({"seeds": {"variants": "baseline", "baseline": [3, 4]}, "eval": {"adjust": "holm"}})
    assert s.seeds.variants == (3, 4) and s.eval.adjust == "holm"
    assert parse({}).eval.adjust == "bonferroni" and parse({}).seeds.variants == (0,)
    for extra, key in [({"seeds": {"variants": "all"}}, "seeds.variants"),
                       ({"eval": {"adjust": "sidak"}}, "eval.adjust"),
                       ({"eval_data": {"bad name": "x"}}, "eval_data.bad name"),
                       ({"eval_data": "x"}, "eval_data")]:
        with pytest.raises(ConfigError, match=f"^suite error: s.yaml: {key}: ") as e:
            parse(extra)
        assert "\n" not in str(e.value)
