"""Downstream zero-shot evaluation in suites: after training, resumed when interrupted, reported."""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from rich.console import Console

import archlab.lab.runner as runner
from archlab.errors import DataError
from archlab.lab.cli import run_compare
from archlab.lab.plan import build_plan
from archlab.lab.report import collect, downstream_table, print_report, results_table, write_report
from archlab.lab.display import RUNS_DIR
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, SCHEMA_VERSION, ResultStore
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import (DOWNSTREAM_EVAL, SUITE_YAML, FakeEval, FakeTrainer, fake_costs, write_suite,
                                 write_tasks)

SUITE = SUITE_YAML.replace("eval: {last_k: 1}\n", DOWNSTREAM_EVAL)


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=200)


def args(suite: Path, out: Path, **kw: object) -> argparse.Namespace:
    base = dict(suite=str(suite), out=out, dry_run=False, overrides=[], variants=None, no_resume=False,
                force=False)
    return argparse.Namespace(**{**base, **kw})


def plan_for(tmp: Path, text: str = SUITE, out: str = "o"):
    write_tasks(tmp / "tasks")
    return build_plan(load_suite(write_suite(tmp, text)), tmp / out, costs_fn=fake_costs)


def evaluated(db: Path) -> dict[str, set[tuple[str, int | None]]]:
    with ResultStore(db, create=False) as store:
        out: dict[str, set[tuple[str, int | None]]] = {}
        for d in store.downstream():
            out.setdefault(d.run_id, set()).add((d.task, d.limit))
        return out


def test_compare_evaluates_every_finished_run_once_and_reports(tmp_path: Path, monkeypatch) -> None:
    fake_eval = FakeEval()
    monkeypatch.setattr(runner, "evaluate_run", fake_eval)  # what run_compare uses by default
    suite_file = write_suite(tmp_path, SUITE)
    write_tasks(tmp_path / "tasks")
    out = tmp_path / "out"
    trainer = FakeTrainer(diverge=("same",))
    console = Console(record=True, width=250, file=open(os.devnull, "w"))
    assert run_compare(args(suite_file, out), train_fn=trainer, costs_fn=fake_costs, console=console) == 0

    with ResultStore(out / DB_NAME, create=False) as store:
        rows = {r.run_id: r for r in store.runs()}
        finished = {i for i, r in rows.items() if r.status == "finished"}
        downstream = store.downstream()
        data = collect(store)
    assert len(finished) == 5 and len(rows) == 7  # "same" diverged: not evaluated
    assert sorted(name for name, _ in fake_eval.calls) == sorted(finished)
    assert all(tasks == ["lambada", "piqa"] for _, tasks in fake_eval.calls)
    assert {d.run_id for d in downstream} == finished and len(downstream) == 10
    assert all(d.limit == 5 and d.n == 5 for d in downstream)
    piqa = [d for d in downstream if d.task == "piqa"]
    assert all(d.metric == "acc_norm" and d.source == str(tmp_path / "tasks" / "piqa.jsonl") for d in piqa)
    assert all(d.metric == "acc" and d.ppl == 40.0 for d in downstream if d.task == "lambada")

    # Report: a column per task with the difference against the baseline (lower-init is +0.05).
    by = {s.label: s for s in data.summaries}
    assert data.tasks == ["piqa", "lambada"] and len(by["llama"].downstream["piqa"]) == 3
    header, table = results_table(data)
    # the loss verdict, a downstream verdict per task family (piqa: commonsense), the task means
    assert header[-5:] == ["verdict", "commonsense verdict", "lambada verdict", "piqa acc_norm", "lambada acc"]
    base, lower = by["llama"].task_mean("piqa"), by["lower-init"].task_mean("piqa")
    assert lower - base == pytest.approx(0.05, abs=0.02)
    assert table[1][-2] == f"{lower:.4f} ({lower - base:+.4f})" and table[0][-2] == f"{base:.4f}"
    assert table[2][-2:] == ["-", "-"]  # diverged
    d_header, d_rows = downstream_table(data)
    assert d_header == ["variant", "seeds", "piqa acc_norm (n=5)", "lambada acc (n=5)"]
    se = by["llama"].task_se("piqa")
    assert se[1] and d_rows[0][2] == f"{base:.4f} ± {se[0]:.4f}" and d_rows[0][1] == "3/3"
    md = (out / "report.md").read_text()
    assert "## Downstream" in md and "| piqa acc_norm (n=5) |" in md and "first 5 items per task" in md
    # results, costs, downstream verdicts, downstream, compute
    assert (out / "report.html").read_text().count("<table>") == 5
    shown = console.export_text()
    assert "downstream: piqa acc_norm" in shown and "lambada acc" in shown

    # Nothing is trained or evaluated again.
    again = FakeTrainer()
    assert run_compare(args(suite_file, out), train_fn=again, costs_fn=fake_costs, console=quiet()) == 0
    assert again.calls == [] and len(fake_eval.calls) == 5


def test_interrupted_evaluation_is_resumed_without_retraining(tmp_path: Path) -> None:
    plan = plan_for(tmp_path)
    trainer = FakeTrainer()
    with ResultStore(plan.out_dir / DB_NAME) as store:
        with pytest.raises(KeyboardInterrupt):  # killed while evaluating the second run
            run_suite(plan, store, list(plan.runs), train_fn=trainer, console=quiet(), eval_fn=FakeEval(fail_on=2))
        second = plan.runs[1].run_id
        assert store.get(second).status == "finished"  # the training result is kept ...
        assert set(evaluated(plan.out_dir / DB_NAME)) == {plan.runs[0].run_id}  # ... its evaluation is not there
        trained = [name for name, _ in trainer.calls]

        resumed, trainer2 = FakeEval(), FakeTrainer()
        out = run_suite(plan, store, list(plan.runs), train_fn=trainer2, console=quiet(), eval_fn=resumed)
    assert out.skipped == 2 and out.finished == 5
    assert second not in [name for name, _ in trainer2.calls] and trained == [r.run_id for r in plan.runs[:2]]
    assert resumed.calls[0] == (second, ["lambada", "piqa"])  # caught up first, before any training
    assert sorted(n for n, _ in resumed.calls) == sorted(r.run_id for r in plan.runs[1:])
    assert all(v == {("piqa", 5), ("lambada", 5)} for v in evaluated(plan.out_dir / DB_NAME).values())


def test_new_tasks_or_limit_evaluate_only_what_is_missing(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, SUITE.replace("tasks: [piqa, lambada]", "tasks: piqa"))
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(), eval_fn=FakeEval())
    more = plan_for(tmp_path, SUITE.replace("tasks: [piqa, lambada]", "tasks: 'piqa, lambada'"))
    assert [r.run_id for r in more.runs] == [r.run_id for r in plan.runs]  # tasks are not part of run ids
    fake, trainer = FakeEval(), FakeTrainer()
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(more, store, list(more.runs), train_fn=trainer, console=quiet(), eval_fn=fake)
        assert trainer.calls == [] and len(fake.calls) == 7 and all(t == ["lambada"] for _, t in fake.calls)
        # A new limit is a new evaluation; the results at the old one stay as they were.
        full = plan_for(tmp_path, SUITE.replace(", limit: 5", ""))
        fake = FakeEval()
        run_suite(full, store, list(full.runs), train_fn=trainer, console=quiet(), eval_fn=fake)
        assert len(fake.calls) == 7 and trainer.calls == []
        assert {d.n for d in store.downstream() if d.limit is None} == {14, 16}
        assert len(store.downstream()) == 7 * 4


def test_runs_without_a_checkpoint_are_reported_not_blocking(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, SUITE_YAML)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs[:3]), train_fn=FakeTrainer(), console=quiet())
    gone = plan.runs[1].run_id
    shutil.rmtree(plan.out_dir / RUNS_DIR / gone)
    with_tasks = plan_for(tmp_path, SUITE)
    console = Console(record=True, width=250, file=open(os.devnull, "w"))
    trainer, fake = FakeTrainer(), FakeEval()
    with ResultStore(plan.out_dir / DB_NAME) as store:
        out = run_suite(with_tasks, store, list(with_tasks.runs), train_fn=trainer, console=console, eval_fn=fake)
    assert out.finished == 4 and len(trainer.calls) == 4 and len(fake.calls) == 7
    assert set(evaluated(plan.out_dir / DB_NAME)) == {r.run_id for r in plan.runs} - {gone}
    assert f"{plan.runs[1].label} seed {plan.runs[1].init_seed}: no downstream evaluation" in console.export_text()


def _three_jobs(tmp_path: Path, fake: FakeEval):
    """The suite with downstream tasks through 3 workers, one label diverging: (the outcome, the
    finished run ids, the console's text), after checking that every finished run is evaluated."""
    plan = plan_for(tmp_path)
    console = Console(record=True, width=250, file=open(os.devnull, "w"))
    with ResultStore(plan.out_dir / DB_NAME) as store:
        out = run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(diverge=("same",)), console=console,
                        jobs=3, eval_fn=fake)
    finished = {r.run_id for r in plan.runs if not r.label == "same"}
    assert set(evaluated(plan.out_dir / DB_NAME)) == finished
    return out, finished, console.export_text()


def test_parallel_jobs_evaluate_in_their_workers(tmp_path: Path) -> None:
    """Each worker evaluates the run it trained (the fake runs there, a copy of the parent's, so
    the parent's records no call); the scores reach the database and the run's end line."""
    fake = FakeEval()
    out, finished, said = _three_jobs(tmp_path, fake)
    assert (out.finished, out.diverged) == (5, 2)
    assert fake.calls == []  # nothing was left to the parent
    assert said.count("downstream: piqa acc_norm") == 5


class FailsInWorkers(FakeEval):
    """``FakeEval`` that raises in any process but the one that made it (compare's)."""

    def __init__(self) -> None:
        super().__init__()
        self.parent = os.getpid()

    def __call__(self, run_dir, cfg, tasks, *, progress=None):
        if os.getpid() != self.parent:
            raise RuntimeError("no GPU memory left for the evaluation")
        return super().__call__(run_dir, cfg, tasks, progress=progress)


def test_a_workers_failed_evaluation_is_left_to_the_parent(tmp_path: Path) -> None:
    fake = FailsInWorkers()
    out, finished, said = _three_jobs(tmp_path, fake)
    assert out.finished == 5 and {n for n, _ in fake.calls} == finished and len(fake.calls) == 5
    assert said.count("downstream evaluation is left to compare (no GPU memory left") == 5


def test_parallel_evaluation_error_lets_running_runs_finish(tmp_path: Path) -> None:
    plan = plan_for(tmp_path)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        with pytest.raises(KeyboardInterrupt):
            run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(), jobs=2,
                      eval_fn=FakeEval(fail_on=1))
        assert not any(r.status == "running" for r in store.runs())  # the other worker's run was recorded
        done = [r.run_id for r in store.runs() if r.status == "finished"]
        fake = FakeEval()
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(), jobs=2, eval_fn=fake)
    assert {n for n, _ in fake.calls[:len(done)]} == set(done)  # caught up first
    assert len(evaluated(plan.out_dir / DB_NAME)) == 7


def test_missing_task_data_fails_before_training(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path, SUITE)), tmp_path / "o", costs_fn=fake_costs)  # no tasks/
    trainer = FakeTrainer()
    with ResultStore(plan.out_dir / DB_NAME) as store:
        with pytest.raises(DataError, match="task data directory .*tasks does not exist"):
            run_suite(plan, store, list(plan.runs), train_fn=trainer, console=quiet(), eval_fn=FakeEval())
        assert trainer.calls == [] and store.runs() == []


def test_downstream_rows_are_immutable_and_of_finished_runs_only(tmp_path: Path) -> None:
    plan = plan_for(tmp_path)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs[:1]), train_fn=FakeTrainer(), console=quiet(), eval_fn=FakeEval())
        first = plan.runs[0].run_id
        with pytest.raises(sqlite3.IntegrityError):  # the same (run, task, limit) twice
            store.add_downstream(first, {"piqa": {"acc": 0.1, "acc_stderr": 0.1, "n": 5}}, limit=5)
        store.start_run(runner._job(plan, plan.runs[1], "rev", None).start)
        with pytest.raises(sqlite3.IntegrityError, match="belong to a finished run"):
            store.add_downstream(plan.runs[1].run_id, {"piqa": {"acc": 0.1, "acc_stderr": 0.1, "n": 5}}, limit=5)
    raw = sqlite3.connect(plan.out_dir / DB_NAME)
    for stmt in ("UPDATE downstream SET acc = 1", "DELETE FROM downstream"):
        with pytest.raises(sqlite3.IntegrityError, match="never"):
            raw.execute(stmt)
    raw.close()


def _downgrade_to_v1(db: Path) -> None:
    """Turn a database into what archlab wrote before schema v2: no downstream table (nor v3's
    claims and runs_at_once, nor v4's latency), and a plan whose suite has no downstream keys."""
    import json

    raw = sqlite3.connect(db, isolation_level=None)
    raw.execute("DROP TABLE downstream")  # its triggers go with it
    raw.execute("DROP TABLE claims")
    raw.execute("DROP TABLE latency")
    raw.execute("DROP TABLE heldout")  # v5
    raw.execute("ALTER TABLE runs DROP COLUMN runs_at_once")
    for column in ("final_rule", "final_val_tokens", "final_val_se", "final_val_batches"):  # v6, v7
        raw.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    plan = json.loads(raw.execute("SELECT value FROM meta WHERE key = 'plan'").fetchone()[0])
    for key in ("tasks", "task_dir", "limit", "adjust", "final_tokens", "families"):
        del plan["suite"]["eval"][key]
    del plan["suite"]["eval_data"]
    for run in plan["runs"]:  # planned budgets and schedules: v6 too
        del run["budget"], run["schedule"]
    raw.execute("UPDATE meta SET value = ? WHERE key = 'plan'", (json.dumps(plan),))
    raw.execute("PRAGMA user_version = 1")
    assert {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {"meta", "runs"}
    raw.close()


def test_a_v1_database_migrates_reports_and_gets_its_evaluations(tmp_path: Path) -> None:
    plain = SUITE_YAML  # a suite from before downstream evaluation
    plan = plan_for(tmp_path, plain)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet())
    _downgrade_to_v1(plan.out_dir / DB_NAME)
    before = (plan.out_dir / DB_NAME).stat().st_size

    md, _ = write_report(plan.out_dir)  # opens (and migrates) the old file and reports it
    assert "| lower-init |" in md.read_text() and "Downstream" not in md.read_text() and before > 0
    # its final losses were recorded under the old rule, and the report says so
    assert "runs recorded before archlab evaluated the final weights alone" in md.read_text()
    assert "Schedule: not recorded" in md.read_text()
    raw = sqlite3.connect(plan.out_dir / DB_NAME)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()
    print_report(plan.out_dir, quiet())

    # The same suite with tasks added: the old runs are evaluated, nothing is retrained.
    with_tasks = plan_for(tmp_path, SUITE)
    trainer, fake = FakeTrainer(), FakeEval()
    with ResultStore(plan.out_dir / DB_NAME) as store:
        out = run_suite(with_tasks, store, list(with_tasks.runs), train_fn=trainer, console=quiet(), eval_fn=fake)
    assert out.skipped == 7 and trainer.calls == [] and len(fake.calls) == 7
    assert "## Downstream" in write_report(plan.out_dir)[0].read_text()


def test_real_trainer_and_evaluation_end_to_end(stdlib_data: Path, tmp_path: Path) -> None:
    """The real trainer, checkpoint loader, tokenizer and scorer on a micro suite (a few seconds)."""
    text = f"""\
name: micro-eval
preset: tiny
base:
  data: {{path: {stdlib_data}}}
  model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2}}
  train: {{batch_size: 4, seq_len: 32, warmup_steps: 2, eval_every: 3, ckpt_every: 3, log_every: 3,
          device: cpu}}
budget: {{tokens: 768, match: iso-token}}   # 6 steps
seeds: {{baseline: [0], variants: [0]}}
baseline: llama
variants:
  wider-init: {{model.init_std: 0.05}}
eval: {{batches: 2, last_k: 1, tasks: 'piqa,lambada', task_dir: tasks, limit: 4}}
"""
    suite_file = write_suite(tmp_path, text)
    write_tasks(tmp_path / "tasks")
    out = tmp_path / "out"
    assert run_compare(args(suite_file, out), console=quiet()) == 0
    with ResultStore(out / DB_NAME, create=False) as store:
        runs = store.runs()
        downstream = store.downstream()
    assert [r.status for r in runs] == ["finished", "finished"]
    assert len(downstream) == 4 and all(d.n == 4 and d.limit == 4 and 0 <= d.value <= 1 for d in downstream)
    assert all(d.ppl is not None and d.ppl > 1 for d in downstream if d.task == "lambada")

    # The same numbers as `archlab eval --tasks` on the run's checkpoint.
    from archlab.eval.harness import evaluate_checkpoint
    from archlab.eval.tasks import load_tasks

    run_dir = out / RUNS_DIR / runs[0].run_id
    direct, _ = evaluate_checkpoint(run_dir, load_tasks("piqa,lambada", tmp_path / "tasks", 4), batch_size=4)
    mine = {d.task: d for d in downstream if d.run_id == runs[0].run_id}
    assert mine["piqa"].acc_norm == direct["piqa"]["acc_norm"] and mine["lambada"].ppl == pytest.approx(
        direct["lambada"]["ppl"])
    assert "## Downstream" in (out / "report.md").read_text()


def test_dry_run_names_the_downstream_tasks(tmp_path: Path) -> None:
    from archlab.lab.display import plan_table

    plan = plan_for(tmp_path)
    _, summary = plan_table(plan, list(plan.runs), {})
    assert "then zero-shot piqa, lambada on every finished run (first 5 items per task" in summary
    _, summary = plan_table(plan_for(tmp_path, SUITE_YAML), list(plan.runs), {})
    assert "zero-shot" not in summary
