"""Running suites: kill and resume, skipped work, divergence, data preparation, CLI options."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from archlab.errors import ArchlabError, ConfigError
from archlab.lab.cli import run_compare
from archlab.lab.plan import build_plan
from archlab.lab.display import RUNS_DIR, plan_table
from archlab.lab.runner import run_suite, suite_lock
from archlab.lab.store import DB_NAME, ResultStore
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import (FINAL_SAMPLE_SHIFT, SUITE_YAML, FakePrepare, FakeTrainer, fake_costs, fake_loss,
                                 write_suite)

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"}


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=200)


def args(suite: Path | str, out: Path, **kw: object) -> argparse.Namespace:
    base = dict(suite=str(suite), out=out, dry_run=False, overrides=[], variants=None, no_resume=False,
                force=False)
    base.update(kw)
    return argparse.Namespace(**base)


def snapshot(db: Path) -> dict[str, tuple]:
    with ResultStore(db, create=False) as store:
        return {r.run_id: (r.status, r.finished_at, r.final_val_loss, r.attempts, json.dumps(r.val_curve))
                for r in store.runs() if r.status == "finished"}


# The suite runs in a child process whose fake trainer hangs in the 4th run (baseline "llama",
# seed 1) right after its checkpoint at step 20; the test kills it there with SIGKILL.
CHILD = """
import sys
from pathlib import Path
from rich.console import Console
from archlab.lab.plan import build_plan
from archlab.lab.runner import run_suite
from archlab.lab.store import ResultStore, DB_NAME
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import FakeTrainer, fake_costs
suite_file, out, log, marker = map(Path, sys.argv[1:5])
plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
fake = FakeTrainer(log=log, hang_at=("llama-s1-", 20), hang_marker=marker)
with ResultStore(out / DB_NAME) as store:
    run_suite(plan, store, list(plan.runs), train_fn=fake, console=Console(width=150))
"""


def test_kill_mid_suite_then_resume(tmp_path: Path) -> None:
    suite_file = write_suite(tmp_path)
    out, log, marker = tmp_path / "out", tmp_path / "calls.jsonl", tmp_path / "hanging"
    plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
    ids = [r.run_id for r in plan.runs]
    assert ids[3].startswith("llama-s1-")

    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(suite_file), str(out), str(log), str(marker)],
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    db = out / DB_NAME
    before = snapshot(db)
    assert sorted(before) == sorted(ids[:3])  # three finished, recorded before the kill
    with ResultStore(db, create=False) as store:
        assert store.get(ids[3]).status == "running"
    assert (out / RUNS_DIR / ids[3] / "ckpt" / "latest").read_text().strip() == "step_0000020"

    fake = FakeTrainer()
    outcome = run_suite(plan, ResultStore(db), list(plan.runs), train_fn=fake, console=quiet())
    assert outcome.skipped == 3 and outcome.finished == 4 and outcome.interrupted is None
    # Nothing finished was re-run; the interrupted run continued from its checkpoint.
    assert fake.calls == [(ids[3], 20)] + [(i, 0) for i in ids[4:]]
    after = snapshot(db)
    assert set(after) == set(ids)
    assert {k: after[k] for k in before} == before  # finished rows untouched
    with ResultStore(db, create=False) as store:
        assert store.get(ids[3]).attempts == 2

    # The resumed run's result equals an uninterrupted run's.
    clean = tmp_path / "clean"
    plan2 = build_plan(load_suite(suite_file), clean, costs_fn=fake_costs)
    run_suite(plan2, ResultStore(clean / DB_NAME), list(plan2.runs), train_fn=FakeTrainer(), console=quiet())
    assert {k: v[2] for k, v in snapshot(clean / DB_NAME).items()} == {k: v[2] for k, v in after.items()}

    # A third call trains nothing.
    idle = FakeTrainer()
    assert run_suite(plan, ResultStore(db), list(plan.runs), train_fn=idle, console=quiet()).skipped == 7
    assert idle.calls == []


def test_stop_after_steps_leaves_the_run_resumable(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "o", costs_fn=fake_costs)
    db = tmp_path / "o" / DB_NAME
    first = run_suite(plan, ResultStore(db), list(plan.runs), train_fn=FakeTrainer(), console=quiet(),
                      stop_after_steps=25)
    assert first.interrupted == plan.runs[0].run_id and first.finished == 0
    with ResultStore(db, create=False) as store:
        assert store.get(plan.runs[0].run_id).status == "running"
    fake = FakeTrainer()
    run_suite(plan, ResultStore(db), list(plan.runs), train_fn=fake, console=quiet())
    assert fake.calls[0] == (plan.runs[0].run_id, 20)  # from the step-20 checkpoint


def test_divergence_is_recorded_and_the_suite_goes_on(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "o", costs_fn=fake_costs)
    db = tmp_path / "o" / DB_NAME
    outcome = run_suite(plan, ResultStore(db), list(plan.runs), train_fn=FakeTrainer(diverge=("same",)),
                        console=quiet())
    assert outcome.diverged == 2 and outcome.finished == 5
    fake = FakeTrainer()
    run_suite(plan, ResultStore(db), list(plan.runs), train_fn=fake, console=quiet())
    assert fake.calls == []  # a diverged run is a result, not retried
    with ResultStore(db, create=False) as store:
        rows = [r for r in store.runs() if r.label == "same"]
        assert {r.status for r in rows} == {"diverged"} and "nan" in (rows[0].error or "")


def test_final_loss_is_the_trainers_final_evaluation(tmp_path: Path) -> None:
    """eval.last_k 1 (the default): the final weights on the final sample, with its sample size and
    standard error, not the curve's last evaluation (on the smaller curve sample)."""
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "o", costs_fn=fake_costs)
    db = tmp_path / "o" / DB_NAME
    run_suite(plan, ResultStore(db), list(plan.runs[:1]), train_fn=FakeTrainer(), console=quiet())
    with ResultStore(db, create=False) as store:
        row = store.get(plan.runs[0].run_id)
    assert row.final_val_loss == fake_loss(plan.runs[0].config, 40) + FINAL_SAMPLE_SHIFT
    assert row.final_val_loss != row.val_curve[-1]["loss"]
    assert (row.final_rule, row.final_val_tokens, row.final_val_se) == ("final weights", 1_048_576, 0.001)
    assert row.costs == {k: v for k, v in plan.runs[0].costs.items() if k in row.costs}


def test_smoothing_averages_only_the_last_tenth_of_training(tmp_path: Path) -> None:
    text = SUITE_YAML.replace("eval: {last_k: 1}", "eval: {last_k: 3, every: 2}")  # steps 36, 38, 40 of 40
    plan = build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o", costs_fn=fake_costs)
    db = tmp_path / "o" / DB_NAME
    run_suite(plan, ResultStore(db), list(plan.runs[:1]), train_fn=FakeTrainer(), console=quiet())
    with ResultStore(db, create=False) as store:
        row = store.get(plan.runs[0].run_id)
    assert [p["step"] for p in row.val_curve[-3:]] == [36, 38, 40]
    assert row.final_val_loss == pytest.approx(sum(p["loss"] for p in row.val_curve[-3:]) / 3)
    assert row.final_rule == "mean of last 3 evaluations (steps 36-40)"


@pytest.mark.parametrize("eval_, fix", [("{last_k: 2}", "eval.every: 4 or less"),  # 35 and 40 of 40
                                        ("{last_k: 3, every: 2}", None)])
def test_smoothing_over_more_than_a_tenth_is_refused(tmp_path: Path, capsys, eval_: str, fix: str | None) -> None:
    from tests.helpers import run_cli

    path = write_suite(tmp_path, SUITE_YAML.replace("eval: {last_k: 1}", f"eval: {eval_}"))
    code, out, err = run_cli(capsys, "compare", str(path), "--dry-run", "--out", str(tmp_path / "o"))
    if fix is None:  # the last 3 evaluations at steps 36-40: inside the last 10%
        assert code == 0, err
        return
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "eval.last_k" in err and "last 10% of training" in err and fix in err


def managed_data_plan(tmp_path: Path, data: str):
    """The fake suite with a suite-managed corpus (``data`` is the suite's data mapping)."""
    text = SUITE_YAML.replace("  data: {path: /nonexistent-data}\n", "").replace("budget:", f"data: {data}\nbudget:")
    return build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o", costs_fn=fake_costs)


def test_managed_data_is_prepared_once(tmp_path: Path) -> None:
    plan = managed_data_plan(tmp_path, "{source: stdlib, max_mb: 1.5}")
    prep = FakePrepare()
    run_suite(plan, ResultStore(tmp_path / "o" / DB_NAME), list(plan.runs[:2]), train_fn=FakeTrainer(),
              prepare_fn=prep, console=quiet())
    assert prep.calls == [dict(source="stdlib", out_dir=tmp_path.resolve() / "o" / "data" / "stdlib-1.5MB-v4096",
                               vocab_size=4096, max_bytes=1_500_000)]
    run_suite(plan, ResultStore(tmp_path / "o" / DB_NAME), list(plan.runs), train_fn=FakeTrainer(),
              prepare_fn=prep, console=quiet())
    assert len(prep.calls) == 1


def test_compare_cli_variants_no_resume_and_report(tmp_path: Path) -> None:
    suite_file, out = write_suite(tmp_path), tmp_path / "o"
    fake = FakeTrainer()
    assert run_compare(args(suite_file, out, variants="same"), train_fn=fake, costs_fn=fake_costs,
                       console=quiet()) == 0
    assert {c[0].split("-s")[0] for c in fake.calls} == {"llama", "same"} and len(fake.calls) == 5
    assert (out / "report.md").is_file() and (out / "report.html").is_file()
    with pytest.raises(ConfigError, match="add --force"):
        run_compare(args(suite_file, out, no_resume=True), train_fn=fake, costs_fn=fake_costs, console=quiet())
    again = FakeTrainer()
    run_compare(args(suite_file, out, no_resume=True, force=True), train_fn=again, costs_fn=fake_costs,
                console=quiet())
    assert len(again.calls) == 7  # everything retrained, from step 0
    assert all(step == 0 for _, step in again.calls)
    archived = list((out / "archive").glob("*/" + DB_NAME))
    assert len(archived) == 1 and len(snapshot(archived[0])) == 5  # the old results are kept aside


def test_dry_run_prints_the_plan_and_trains_nothing(tmp_path: Path) -> None:
    suite_file, out = write_suite(tmp_path), tmp_path / "o"
    text = suite_file.read_text() + "estimate: {tokens_per_s: 2048}\n"
    suite_file.write_text(text)
    console = Console(record=True, width=250)
    fake = FakeTrainer()
    assert run_compare(args(suite_file, out, dry_run=True), train_fn=fake, costs_fn=fake_costs,
                       console=console) == 0
    shown = console.export_text()
    assert fake.calls == [] and not out.exists()
    assert "7 of 7 runs to train" in shown and "lower-init s1" in shown
    assert "estimated time 4m40s" in shown  # 7 runs x 40 s at the assumed 2048 tokens/s
    # After some runs finish, the plan shows them done and measures the rate.
    plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
    run_suite(plan, ResultStore(out / DB_NAME), list(plan.runs[:2]), train_fn=fake, console=quiet())
    with ResultStore(out / DB_NAME, create=False) as store:
        table, summary = plan_table(plan, list(plan.runs), {r.run_id: r for r in store.runs()})
    assert summary.startswith("5 of 7 runs to train") and "measured" in summary


def test_compares_share_a_suite_directory_but_no_resume_runs_alone(tmp_path: Path) -> None:
    with suite_lock(tmp_path):
        with suite_lock(tmp_path):  # a second compare joins (run claims keep them apart)
            pass
        with pytest.raises(ArchlabError, match="another archlab compare is running.*--no-resume would move"):
            with suite_lock(tmp_path, exclusive=True):
                pass
    with suite_lock(tmp_path, exclusive=True):  # released
        with pytest.raises(ArchlabError, match="another archlab compare is starting .* over"):
            with suite_lock(tmp_path):
                pass


def test_parallel_jobs_give_the_sequential_results(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "seq", costs_fn=fake_costs)
    with ResultStore(tmp_path / "seq" / DB_NAME) as store:
        out = run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet())
    assert out.finished == 7
    par_plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "par", costs_fn=fake_costs)
    with ResultStore(tmp_path / "par" / DB_NAME) as store:
        out = run_suite(par_plan, store, list(par_plan.runs), train_fn=FakeTrainer(diverge=("same",)),
                        console=quiet(), jobs=3)
    assert (out.finished, out.diverged, out.interrupted) == (5, 2, None)
    seq, par = snapshot(tmp_path / "seq" / DB_NAME), snapshot(tmp_path / "par" / DB_NAME)
    assert set(par) < set(seq)  # the same run ids (the directory is not part of them) ...
    for run_id, row in par.items():  # ... and the same final losses and curves
        assert row[2] == seq[run_id][2] and row[4] == seq[run_id][4]
    with ResultStore(tmp_path / "par" / DB_NAME, create=False) as store:
        assert sorted(r.status for r in store.runs()) == ["diverged"] * 2 + ["finished"] * 5


def test_parallel_jobs_stop_short_and_resume(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "o", costs_fn=fake_costs)
    with ResultStore(tmp_path / "o" / DB_NAME) as store:
        out = run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(),
                        stop_after_steps=15, jobs=2)
        assert out.finished == 0 and out.interrupted is not None
        assert sum(r.status == "running" for r in store.runs()) == 2  # no new run started after a stop
        out = run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(), jobs=2)
        assert out.finished == 7


def test_compare_jobs_must_be_positive(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "archlab.cli", "compare", str(write_suite(tmp_path)),
                           "--jobs", "0", "--dry-run"], capture_output=True, text=True, env=ENV, cwd=tmp_path)
    assert proc.returncode == 2 and "--jobs: must be at least 1" in proc.stderr


def test_recipe_data_is_prepared_from_the_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import archlab.data.recipes as recipes

    opened: list[tuple[str, int | None]] = []
    monkeypatch.setattr(recipes, "open_recipe",
                        lambda name, max_bytes=None: opened.append((name, max_bytes)) or f"<{name} source>")
    plan = managed_data_plan(tmp_path, "{recipe: shakespeare, max_mb: 2}")
    prep = FakePrepare()
    run_suite(plan, ResultStore(tmp_path / "o" / DB_NAME), list(plan.runs[:1]), train_fn=FakeTrainer(),
              prepare_fn=prep, console=quiet())
    assert opened == [("shakespeare", 2_000_000)]
    assert prep.calls == [dict(source="<shakespeare source>", max_bytes=None, vocab_size=4096,
                               out_dir=tmp_path.resolve() / "o" / "data" / "shakespeare-2MB-v4096")]


def _eta_shown(progress) -> str:
    """What the suite's bar shows in its ETA column right now."""
    from archlab.lab.display import EtaColumn

    column = next(c for c in progress.columns if isinstance(c, EtaColumn))
    task = next(t for t in progress.tasks if "eta" in t.fields)
    return column.render(task).plain


def test_suite_eta_from_tokens_left_and_rates(tmp_path: Path) -> None:
    """The suite's ETA is the tokens still to train over the expected rates: the suite's
    estimate before anything is measured, shared by the runs trained at once; measured rates
    once runs finish; a resumed run counts only what it has left."""
    from archlab.lab.display import SuiteEta

    suite_file = write_suite(tmp_path)
    suite_file.write_text(suite_file.read_text() + "estimate: {tokens_per_s: 2048}\n")
    plan = build_plan(load_suite(suite_file), tmp_path / "o", costs_fn=fake_costs)
    runs = list(plan.runs)
    assert SuiteEta(plan, {}, runs, jobs=1).estimate() == pytest.approx(7 * 81920 / 2048)  # 280 s
    assert SuiteEta(plan, {}, runs, jobs=2).estimate() == pytest.approx(7 * 81920 / 2048 / 2)
    assert SuiteEta(plan, {}, runs, jobs=8).estimate() == pytest.approx(81920 / 2048)  # 7 at once
    run_dir = plan.out_dir / RUNS_DIR / runs[0].run_id  # half of the first run logged: resumed
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 20, "tokens": 40960,
                                                       "loss": 3.0, "tokens_per_s": 4096.0}) + "\n")
    eta = SuiteEta(plan, {}, runs, jobs=1)
    # the live llama rate (4096 tok/s) replaces the estimate for llama and scales to the others
    assert eta.estimate() == pytest.approx(40960 / 4096 + 2 * 81920 / 4096 + 4 * 81920 / 4096)
    assert eta.seconds() == pytest.approx(eta.estimate(), abs=0.5)
    for run in runs:
        eta.ended(run, None)
    assert eta.seconds() == 0.0

    # Without any estimate: unknown until the first run has measured a rate.
    plain = build_plan(load_suite(write_suite(tmp_path, name="plain.yaml")), tmp_path / "p", costs_fn=fake_costs)
    assert SuiteEta(plain, {}, list(plain.runs), jobs=1).estimate() is None


def test_the_suite_bar_shows_an_eta_while_it_trains(tmp_path: Path) -> None:
    """Through run_suite: the ETA the bar shows whenever a run starts is a time, not -:--:--;
    without an estimate in the suite, from the first measured run on."""
    seen: list[str] = []
    inner = FakeTrainer()

    def spy(cfg, out_dir, **kw):
        seen.append(_eta_shown(kw["progress"]))
        return inner(cfg, out_dir, **kw)

    suite_file = write_suite(tmp_path)
    suite_file.write_text(suite_file.read_text() + "estimate: {tokens_per_s: 2048}\n")
    plan = build_plan(load_suite(suite_file), tmp_path / "o", costs_fn=fake_costs)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=spy, console=quiet())
    assert seen[0] in ("0:04:40", "0:04:39")  # 7 runs x 81920 tokens at 2048 tokens/s
    assert all(s != "-:--:--" for s in seen) and len(seen) == 7

    seen.clear()
    plan = build_plan(load_suite(write_suite(tmp_path, name="plain.yaml")), tmp_path / "p", costs_fn=fake_costs)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=spy, console=quiet())
    assert seen[0] == "-:--:--" and all(s != "-:--:--" for s in seen[1:])


def test_code_revision_is_named_by_the_environment_where_git_cannot_tell(monkeypatch) -> None:
    """A working tree copied without its history (a device call) names its revision itself."""
    from archlab.lab.runner import code_revision

    monkeypatch.setenv("ARCHLAB_CODE_REVISION", "abc1234+uncommitted")
    assert code_revision() == "abc1234+uncommitted"
    monkeypatch.delenv("ARCHLAB_CODE_REVISION")
    assert code_revision() != "abc1234+uncommitted"


# `archlab compare --jobs 2` through the main CLI, its trainer and cost model replaced by the fakes;
# both workers hang after their step-20 checkpoints, and the test sends the compare SIGTERM there.
SIGTERM_CHILD = """
import sys
import archlab.lab.cli as lab_cli
from archlab.cli import main
from tests.lab.lab_fakes import FakeTrainer, fake_costs
suite_file, out, marker = sys.argv[1:4]
fake, real = FakeTrainer(hang_at=("", 20), hang_marker=__import__("pathlib").Path(marker)), lab_cli.run_compare
lab_cli.run_compare = lambda args: real(args, train_fn=fake, costs_fn=fake_costs)
sys.exit(main(["compare", suite_file, "--out", out, "--jobs", "2"]))
"""


def test_sigterm_stops_a_parallel_compare_cleanly_and_its_runs_resume(tmp_path: Path) -> None:
    """SIGTERM unwinds like Ctrl-C: the workers are stopped, the process exits with the one line
    an interrupt gets (no traceback, no multiprocessing warning of leaked semaphores, which a
    process killed in the signal leaves to its resource tracker), and the next compare resumes."""
    from tests.lab.test_lab_claims import gone, hanging_compare

    suite_file, out, marker = write_suite(tmp_path), tmp_path / "out", tmp_path / "hanging"
    with hanging_compare(SIGTERM_CHILD, suite_file, out, marker) as (proc, hanging):
        workers = [int(pid) for pid in hanging.values()]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "leaked semaphore" not in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "archlab: interrupted; finished work and the last checkpoint are kept"
    assert all(gone(pid) for pid in workers)

    fake = FakeTrainer()
    plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
    with ResultStore(out / DB_NAME) as store:
        outcome = run_suite(plan, store, list(plan.runs), train_fn=fake, console=quiet())
        assert outcome.finished == 7 and store.claims() == {}
    assert {name: step for name, step in fake.calls if name in hanging} == {name: 20 for name in hanging}
