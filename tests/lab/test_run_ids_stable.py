"""Run ids across archlab versions: a suite resumed after an upgrade finds its finished runs.

A run id hashes the run's config. Options added later either stay out of the config at their
defaults (``LATER_FIELDS``) or, for runs recorded while a new key was written, are matched by
content (``adopt_recorded_ids``). The databases committed under docs/results are real suites
recorded by earlier versions: each must still plan onto its finished runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from archlab.config import make_config
from archlab.lab.plan import adopt_recorded_ids, build_plan
from archlab.lab.store import ResultStore
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import SUITE_YAML, fake_costs, write_suite

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.mark.parametrize("suite", ["lengths-20m", "layer-dropout-20m", "two-hop", "decode-compute", "diffusion",
                                   "downstream-70m"])
def test_recorded_suites_find_their_finished_runs(tmp_path: Path, suite: str) -> None:
    copy = tmp_path / "results.sqlite"  # opening a store may upgrade its schema: not the committed file
    shutil.copyfile(RESULTS / suite / "results.sqlite", copy)
    with ResultStore(copy, create=False) as store:
        rows = store.runs()
    finished = {r.run_id for r in rows if r.status == "finished"}
    assert finished
    # the real cost model: iso-FLOP runs take their steps from it
    plan = adopt_recorded_ids(build_plan(load_suite(suite), tmp_path / suite), rows)
    assert finished <= {r.run_id for r in plan.runs}


def test_later_fields_at_their_defaults_stay_out_of_the_config() -> None:
    plain = make_config("tiny", overrides=["model.schedule=layer_dropout"]).to_dict()
    assert "init_from" not in plain["train"] and "objective" not in plain["model"]
    assert "exit_loss" not in plain["model"]["layer_dropout"] and "exits" not in plain["model"]["layer_dropout"]
    set_ = make_config("tiny", overrides=["model.schedule=layer_dropout", "model.layer_dropout.exit_loss=0.5",
                                          "train.init_from=/some/ckpt"]).to_dict()
    assert set_["train"]["init_from"] == "/some/ckpt"
    assert set_["model"]["layer_dropout"]["exit_loss"] == 0.5  # exits at its default still left out
    assert "exits" not in set_["model"]["layer_dropout"]


def _recorded(run, **changes) -> SimpleNamespace:
    """A store row for ``run`` as an older archlab wrote it: ``init_from: null`` in its config
    (the key the older version wrote), under an id this version does not compute."""
    tree = json.loads(json.dumps(run.config.to_dict()))
    tree["train"]["init_from"] = None
    for key, value in changes.items():
        section, name = key.split(".")
        tree[section][name] = value
    return SimpleNamespace(run_id=f"{run.label}-s{run.init_seed}-d{run.data_seed}-old", suite="fake",
                           label=run.label, init_seed=run.init_seed, data_seed=run.data_seed, config=tree)


def test_a_run_recorded_with_an_extra_default_key_is_adopted(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "out", costs_fn=fake_costs)
    first, second, third = plan.runs[:3]
    rows = [_recorded(first),
            _recorded(second, **{"train.lr": second.config.train.lr * 2}),  # another experiment
            SimpleNamespace(**{**vars(_recorded(third)), "suite": "other-suite"}),  # another suite
            SimpleNamespace(**{**vars(_recorded(first)), "run_id": plan.runs[3].run_id, "label": "x"})]
    adopted = adopt_recorded_ids(plan, rows)
    ids = [r.run_id for r in adopted.runs]
    assert ids[0] == "llama-s0-d0-old" and rows[0].run_id in ids
    assert ids[1] == second.run_id and ids[2] == third.run_id  # not the same config, not the same suite
    assert ids[3] == plan.runs[3].run_id  # its own id is recorded: kept
    assert len(set(ids)) == len(ids)


def test_a_suite_managed_data_path_recorded_elsewhere_is_the_same_data(tmp_path: Path) -> None:
    text = SUITE_YAML.replace("  data: {path: /nonexistent-data}\n", "").replace(
        "budget:", "data: {source: stdlib, max_mb: 2}\nbudget:")
    plan = build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "out", costs_fn=fake_costs)
    first = plan.runs[0]
    inside = Path(first.config.data.path).relative_to(plan.out_dir)
    moved = _recorded(first, **{"data.path": f"/elsewhere/out/{inside}"})  # the suite on another machine
    assert adopt_recorded_ids(plan, [moved]).runs[0].run_id == moved.run_id
    other = _recorded(first, **{"data.path": "/elsewhere/out/data/stdlib-all-v4096"})  # other data
    assert adopt_recorded_ids(plan, [other]).runs[0].run_id == first.run_id
