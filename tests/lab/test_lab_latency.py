"""Measured latency in suites: the costs keys, fitting shapes, once per variant after training,
resumed without re-measuring, added to a finished suite, stored (schema v4) and reported."""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from rich.console import Console

from archlab.errors import ConfigError
from archlab.lab import latency
from archlab.lab.store.owner import Owner
from archlab.lab.cli import run_compare
from archlab.lab.latency import DECODE_MARGIN, MIN_STEPS, fit_decode, shapes_for
from archlab.lab.plan import build_plan
from archlab.lab.report import LATENCY_FIGURE, collect, costs_table, write_report
from archlab.lab.display import RUNS_DIR, plan_table
from archlab.lab.runner import _job, run_suite
from archlab.lab.store import DB_NAME, LATENCY_KEY, SCHEMA_VERSION, LatencyRow, ResultStore
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import MEASURE_COSTS, SUITE_YAML, FakeMeasure, FakeTrainer, fake_costs, write_suite

PNG = b"\x89PNG\r\n\x1a\n"
SUITE = SUITE_YAML + MEASURE_COSTS


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=250)


def recording() -> Console:
    return Console(record=True, width=250, file=open(os.devnull, "w"))


def args(suite: Path, out: Path, **kw: object) -> argparse.Namespace:
    base = dict(suite=str(suite), out=out, dry_run=False, overrides=[], variants=None, no_resume=False,
                force=False)
    return argparse.Namespace(**{**base, **kw})


def plan_for(tmp: Path, text: str = SUITE, out: str = "o"):
    return build_plan(load_suite(write_suite(tmp, text)), tmp / out, costs_fn=fake_costs)


def latencies(db: Path) -> list[LatencyRow]:
    with ResultStore(db, create=False) as store:
        return store.latency()


# ---- the suite's keys and the shapes ------------------------------------------------------------
def test_costs_keys_defaults_errors_and_run_ids(tmp_path: Path) -> None:
    plain = load_suite(write_suite(tmp_path)).costs
    assert (plain.measure, plain.prompt, plain.batches, plain.steps) == ("auto", 2048, (1, 8), 100)
    suite = load_suite(write_suite(tmp_path, SUITE))
    c = suite.costs
    assert (c.measure, c.prompt, c.context, c.batches, c.steps) == ("always", 32, 16, (1, 8), 3)
    assert suite.to_dict()["costs"] == {"context": 16, "dtype_bytes": 2, "measure": "always", "prompt": 32,
                                        "batches": [1, 8], "steps": 3}
    assert c.measures_on("cpu") and not plain.measures_on("cpu") and plain.measures_on("cuda")
    never = load_suite(write_suite(tmp_path, SUITE_YAML + "costs: {measure: never}\n")).costs
    assert not never.measures_on("cuda")
    # Measuring changes nothing that is trained: the same run ids with or without it.
    assert [r.run_id for r in plan_for(tmp_path).runs] == [r.run_id for r in plan_for(tmp_path, SUITE_YAML).runs]
    for text, message in [("costs: {measure: sometimes}", "costs.measure: must be one of auto, always, never"),
                          ("costs: {batches: []}", "costs.batches: expected a non-empty list"),
                          ("costs: {batches: [1, 0]}", "costs.batches: expected a non-empty list"),
                          ("costs: {batches: [8, 8]}", "costs.batches: has repeated batch sizes"),
                          ("costs: {batches: 8}", "costs.batches: expected a list of int"),
                          ("costs: {prompt: 0}", "costs.prompt: must be positive"),
                          ("costs: {steps: -1}", "costs.steps: must be positive"),
                          ("costs: {mesure: always}", "costs.mesure: unknown key; allowed here: context, "
                                                      "dtype_bytes, measure, prompt, batches, steps")]:
        with pytest.raises(ConfigError) as info:
            load_suite(write_suite(tmp_path, SUITE_YAML + text + "\n"))
        assert message in str(info.value) and "\n" not in str(info.value)


def test_shapes_fit_the_model(tmp_path: Path) -> None:
    """As asked when they fit; else the prompt is cut to max_seq_len, the timed decode steps shrink
    (down to MIN_STEPS), then the context; a model without room gets no decode shapes."""
    assert fit_decode(1024, 100, 2048) == (1024, 100)
    assert fit_decode(1024, 100, 1024) == (1024 - DECODE_MARGIN - MIN_STEPS, MIN_STEPS)  # 20m/124m presets
    assert fit_decode(1024, 100, 256) == (256 - DECODE_MARGIN - MIN_STEPS, MIN_STEPS)
    assert fit_decode(16, 3, 32) == (13, 3)
    assert fit_decode(1024, 100, 32) == (8, 8)  # half the room for the steps at most
    assert fit_decode(950, 100, 1024) == (950, 1024 - DECODE_MARGIN - 950)  # the steps give way first
    assert fit_decode(16, 3, DECODE_MARGIN + 1) is None
    for ctx, steps, msl in [(1024, 100, 1024), (5, 500, 300), (1, 1, 18), (2000, 1, 2048)]:
        c, s = fit_decode(ctx, steps, msl)
        assert 1 <= c <= ctx and 1 <= s <= steps and c + s + DECODE_MARGIN <= msl
    text = SUITE_YAML + "costs: {prompt: 2048, context: 1024, batches: [1, 8]}\n"
    spec = load_suite(write_suite(tmp_path, text)).costs
    shapes = shapes_for(spec, 1024, 1024)
    assert [(s.phase, s.batch, s.requested, s.length, s.steps) for s in shapes] == [
        ("prefill", 1, 2048, 1024, latency.PREFILL_REPS), ("decode", 1, 1024, 976, 32), ("decode", 8, 1024, 976, 32)]
    assert [s.key for s in shapes_for(spec, 1024, 16)] == [("prefill", 1, 2048)]  # no room to decode


# ---- in a suite ---------------------------------------------------------------------------------
def test_compare_measures_each_variant_once_after_training_and_reports(tmp_path: Path) -> None:
    suite_file = write_suite(tmp_path, SUITE)
    out = tmp_path / "out"
    trainer, measure = FakeTrainer(diverge=("same",)), FakeMeasure()
    console = recording()
    assert run_compare(args(suite_file, out), train_fn=trainer, costs_fn=fake_costs, console=console,
                       measure_fn=measure) == 0
    plan = plan_for(tmp_path, SUITE, "out")
    first = {label: next(r.run_id for r in plan.runs if r.label == label) for label in ("llama", "lower-init")}
    # One call per label with a finished run, on its first seed, after every run trained ("same" diverged).
    assert [name for name, _, _ in measure.calls] == [first["llama"], first["lower-init"]]
    assert all(keys == [("prefill", 1, 32), ("decode", 1, 16), ("decode", 8, 16)] for _, keys, _ in measure.calls)
    from archlab.io.device import resolve_device

    # The runs' device (train.device auto: the CPU here), measured whatever it is (always).
    assert all(device == str(resolve_device("auto")) for _, _, device in measure.calls)
    rows = latencies(out / DB_NAME)
    assert len(rows) == 6 and len({r.session for r in rows}) == 1
    assert all(r.length == r.requested and r.max_seq_len == 256 and r.device == "fake-gpu" for r in rows)
    shown = console.export_text()
    assert "measuring latency of 2 variant(s)" in shown and "latency of 2 variants measured" in shown
    assert "llama seed 0 latency (fake-gpu, bfloat16, cuda-events): prefill batch 1, prompt 32: 0.320 ms" in shown

    # The report: measured columns with the ratio to the baseline, the note, the figure.
    with ResultStore(out / DB_NAME, create=False) as store:
        data = collect(store)
    header, table = costs_table(data)
    assert header[-3:] == ["prefill ms (prompt 32)", "decode ms/token b1 (ctx 16)", "decode ms/token b8 (ctx 16)"]
    by = {r[0]: r for r in table}
    assert by["llama"][-3:] == ["0.320", "0.566", "0.916"]
    assert by["lower-init"][-3:] == ["0.352 (1.10×)", "0.623 (1.10×)", "1.01 (1.10×)"]
    assert by["same"][-3:] == ["-", "-", "-"]
    md = (out / "report.md").read_text()
    assert "| prefill ms (prompt 32) |" in md and "0.352 (1.10×)" in md
    assert "Measured latency: fake-gpu, bfloat16, CUDA events; final checkpoint of one run per variant, " \
           "1 measuring session" in md
    assert "the inference engine of archlab serve" in md and "first finished seed" in md
    assert f"]({LATENCY_FIGURE[0]})" in md and (out / LATENCY_FIGURE[0]).read_bytes().startswith(PNG)
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "decode ms/token b8 (ctx 16)" in page
    assert "1.01 (1.10×)" in page

    # A resumed suite measures nothing again.
    again, trainer2 = FakeMeasure(), FakeTrainer(diverge=("same",))
    assert run_compare(args(suite_file, out), train_fn=trainer2, costs_fn=fake_costs, console=quiet(),
                       measure_fn=again) == 0
    assert again.calls == [] and trainer2.calls == []
    assert len(latencies(out / DB_NAME)) == 6


def test_adding_measure_to_a_finished_suite_measures_without_retraining(tmp_path: Path, monkeypatch) -> None:
    fake = FakeMeasure()
    monkeypatch.setattr(latency, "measure_run", fake)  # what run_compare uses by default
    out = tmp_path / "out"
    never = write_suite(tmp_path, SUITE_YAML + "costs: {measure: never, context: 16}\n")
    assert run_compare(args(never, out), train_fn=FakeTrainer(), costs_fn=fake_costs, console=quiet()) == 0
    assert fake.calls == [] and latencies(out / DB_NAME) == []
    md = (out / "report.md").read_text()
    assert "Measured latency: none (costs.measure is never)" in md and "prefill ms" not in md
    assert LATENCY_FIGURE[0] not in md and (out / "report.html").read_text().count("data:image/png") == 3

    trainer = FakeTrainer()
    assert run_compare(args(write_suite(tmp_path, SUITE), out), train_fn=trainer, costs_fn=fake_costs,
                       console=quiet()) == 0
    assert trainer.calls == [] and len(fake.calls) == 3 and len(latencies(out / DB_NAME)) == 9
    assert "| prefill ms (prompt 32) |" in (out / "report.md").read_text()

    # A new batch size: only that shape, on the runs measured before; a new prompt likewise.
    more = SUITE.replace("batches: [1, 8]", "batches: [1, 8, 16]")
    measured = [name for name, _, _ in fake.calls]
    assert run_compare(args(write_suite(tmp_path, more), out), train_fn=trainer, costs_fn=fake_costs,
                       console=quiet()) == 0
    assert [c[:2] for c in fake.calls[3:]] == [(name, [("decode", 16, 16)]) for name in measured]
    assert trainer.calls == []
    with ResultStore(out / DB_NAME, create=False) as store:
        data = collect(store)
    assert len({r.session for s in data.summaries for r in s.latency.values()}) == 2
    header, table = costs_table(data)
    assert header[-1] == "decode ms/token b16 (ctx 16)" and table[1][-1] == "1.45 (1.10×)"
    # lower-init's batch-1 figures and the baseline's come from the same session: no mark.
    assert table[1][-3] == "0.623 (1.10×)"


def test_resumed_pass_and_a_missing_checkpoint(tmp_path: Path) -> None:
    plan = plan_for(tmp_path)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        with pytest.raises(KeyboardInterrupt):  # killed while measuring the second variant
            run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(),
                      measure_fn=FakeMeasure(fail_on=2))
        assert all(r.status == "finished" for r in store.runs())  # training results kept
        assert LATENCY_KEY not in store.claims()  # the claim went with the pass
        assert {r.run_id for r in store.latency()} == {plan.runs[0].run_id}
        # lower-init's first seed is gone (run directory deleted to save space): its next seed.
        shutil.rmtree(plan.out_dir / RUNS_DIR / plan.runs[1].run_id)
        resumed = FakeMeasure()
        out = run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(), measure_fn=resumed)
    assert out.skipped == 7 and out.measured == 2
    by_label = {r.label: [x.run_id for x in plan.runs if x.label == r.label] for r in plan.runs}
    assert [n for n, _, _ in resumed.calls] == [by_label["lower-init"][0], by_label["lower-init"][1],
                                                by_label["same"][0]]
    assert {r.run_id for r in latencies(plan.out_dir / DB_NAME)} == {
        by_label["llama"][0], by_label["lower-init"][1], by_label["same"][0]}


def test_not_measured_while_runs_train_on_this_host_or_another_process_measures(tmp_path: Path) -> None:
    plan = plan_for(tmp_path)
    me = Owner.current()
    parent = Owner(pid=os.getppid(), host=me.host, boot=me.boot, started="")
    with ResultStore(plan.out_dir / DB_NAME) as store:
        store.claim("other-run-s0-d0-0123456789", me)  # a live process training here
        console, fake = recording(), FakeMeasure()
        out = run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=console, measure_fn=fake)
        assert out.finished == 7 and out.measured == 0 and fake.calls == []
        assert "1 run(s) training on this host now; measuring later" in console.export_text()
        store.release("other-run-s0-d0-0123456789", me)
        assert store.runs_on_host() == 0
        store.claim(LATENCY_KEY, parent)  # another live process measuring this suite
        assert store.runs_on_host() == 0  # a measurement is not a run
        console = recording()
        assert run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=console,
                         measure_fn=fake).measured == 0
        assert fake.calls == [] and f"latency: being measured by pid {os.getppid()}" in console.export_text()
        store.release(LATENCY_KEY, parent)
        assert run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(),
                         measure_fn=fake).measured == 3
        assert len(fake.calls) == 3 and LATENCY_KEY not in store.claims()


def test_auto_measures_cuda_runs_only(tmp_path: Path, monkeypatch) -> None:
    import torch

    import archlab.io.device as device

    auto = SUITE.replace("measure: always", "measure: auto")
    cpu = auto.replace("train: {warmup_steps: 2,", "train: {device: cpu, warmup_steps: 2,")
    plan = plan_for(tmp_path, cpu)
    _, summary = plan_table(plan, list(plan.runs), {})
    assert "measured latency" not in summary
    with ResultStore(plan.out_dir / DB_NAME) as store:
        fake = FakeMeasure()
        assert run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(),
                         measure_fn=fake).measured == 0
        assert fake.calls == []
    md = write_report(plan.out_dir)[0].read_text()
    assert "Measured latency: none (costs.measure auto measures runs trained on CUDA; always also times CPU runs)" in md

    # On CUDA (pretended: the runs' device resolves to it) the same setting measures, there.
    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device("cuda"))
    plan = plan_for(tmp_path, auto, "cuda")
    _, summary = plan_table(plan, list(plan.runs), {})
    assert ("then measured latency of runs on CUDA (costs.measure auto), one finished run per variant: prefill "
            "of 32 tokens, decode at batch 1, 8 with context 16") in summary
    with ResultStore(plan.out_dir / DB_NAME) as store:
        fake = FakeMeasure()
        assert run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(),
                         measure_fn=fake).measured == 3
    assert [d for _, _, d in fake.calls] == ["cuda"] * 3


def test_a_variant_measured_in_another_session_or_on_another_device(tmp_path: Path) -> None:
    """Ratios are of the same device and dtype; across sessions they are marked (‡)."""
    plan = plan_for(tmp_path)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        with pytest.raises(KeyboardInterrupt):  # llama and lower-init measured, "same" not
            run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(),
                      measure_fn=FakeMeasure(fail_on=3))
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(),
                  measure_fn=FakeMeasure(device="other-gpu"))
        data = collect(store)
    _, table = costs_table(data)
    assert table[1][-1] == "1.01 (1.10×)" and table[2][-1] == "0.916 (other device)"
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(), measure_fn=FakeMeasure())
        data = collect(store)
    assert costs_table(data)[1][2][-1] == "0.916 (other device)"  # recorded: never measured again
    later = plan_for(tmp_path, SUITE.replace("batches: [1, 8]", "batches: [1, 8, 2]"))
    with ResultStore(plan.out_dir / DB_NAME) as store:
        with pytest.raises(KeyboardInterrupt):  # the baseline's b2 in a session of its own
            run_suite(later, store, list(later.runs), train_fn=FakeTrainer(), console=quiet(),
                      measure_fn=FakeMeasure(fail_on=2))
        run_suite(later, store, list(later.runs), train_fn=FakeTrainer(), console=quiet(), measure_fn=FakeMeasure())
        data = collect(store)
    assert costs_table(data)[1][1][-1] == "0.678 (1.10×‡)"
    assert "‡: measured in another session than the baseline's" in (write_report(plan.out_dir)[0].read_text())


# ---- the store --------------------------------------------------------------------------------------
def _row(run_id: str, **kw: object) -> LatencyRow:
    base = dict(run_id=run_id, phase="decode", batch=1, requested=1024, length=976, max_seq_len=1024, steps=32,
                ms=0.8, timer="cuda-events", device="NVIDIA H200", dtype="bfloat16", mfu=None, roofline_ms=0.2,
                bandwidth=float("nan"), session="s1", code_revision="rev", measured_at=1.0)
    return LatencyRow(**{**base, **kw})  # type: ignore[arg-type]


def test_a_v3_database_migrates_to_v4_and_takes_latencies(tmp_path: Path) -> None:
    """A v3 file (before measured latency) opens as v4 with every row intact; the new table keeps
    the invariants of the others (finished runs only, never updated or deleted)."""
    import json

    plan = plan_for(tmp_path, SUITE_YAML)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs[:3]), train_fn=FakeTrainer(), console=quiet())
        store.start_run(_job(plan, plan.runs[3], "rev", None).start)
    db = plan.out_dir / DB_NAME
    raw = sqlite3.connect(db, isolation_level=None)  # what a v3 archlab left: no latency table, older plan
    raw.execute("DROP TABLE latency")
    raw.execute("DROP TABLE heldout")  # v5
    for column in ("final_rule", "final_val_tokens", "final_val_se", "final_val_batches"):  # v6, v7
        raw.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    raw.execute("ALTER TABLE downstream DROP COLUMN chance")
    meta = json.loads(raw.execute("SELECT value FROM meta WHERE key = 'plan'").fetchone()[0])
    for key in ("measure", "prompt", "batches", "steps"):
        del meta["suite"]["costs"][key]
    raw.execute("UPDATE meta SET value = ? WHERE key = 'plan'", (json.dumps(meta),))
    raw.execute("PRAGMA user_version = 3")
    columns = ", ".join(r[1] for r in raw.execute("PRAGMA table_info(runs)"))  # v3's
    before = [tuple(r) for r in raw.execute(f"SELECT {columns} FROM runs ORDER BY run_id")]
    raw.close()

    md, _ = write_report(plan.out_dir)  # opens (and migrates) the old file and reports it
    assert "Measured latency: none (costs.measure auto measures runs trained on CUDA" in md.read_text()
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
    assert [tuple(r) for r in raw.execute(f"SELECT {columns} FROM runs ORDER BY run_id")] == before
    raw.close()
    done, running = plan.runs[0].run_id, plan.runs[3].run_id
    with ResultStore(db, create=False) as store:
        assert store.latency() == []
        store.add_latency([_row(done), _row(done, phase="prefill", requested=2048, length=1024, mfu=0.3)])
        got = {r.phase: r for r in store.latency(done)}
        assert got["decode"] == _row(done, bandwidth=None)  # NaN bandwidth (CPU) is stored as NULL
        assert got["prefill"].mfu == 0.3 and got["prefill"].shape == ("prefill", 1, 2048)
        with pytest.raises(sqlite3.IntegrityError):  # the same (run, phase, batch, requested) twice
            store.add_latency([_row(done, ms=0.1)])
        with pytest.raises(sqlite3.IntegrityError, match="belong to a finished run"):
            store.add_latency([_row(running)])
        assert store.integrity_ok() and len(store.latency()) == 2
    raw = sqlite3.connect(db)
    for stmt in ("UPDATE latency SET ms = 0", "DELETE FROM latency"):
        with pytest.raises(sqlite3.IntegrityError, match="never"):
            raw.execute(stmt)
    raw.close()


# ---- the real engine on CPU -----------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Single-threaded torch: the CPU is shared with other tests and agents."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_real_trainer_and_engine_measure_on_cpu(stdlib_data: Path, tmp_path: Path, one_thread: None) -> None:
    """The real trainer, checkpoint loader and engine on a micro suite whose model has 32 positions:
    the prompt (64) is cut to 32 and the decode context (16 + 3 timed steps) to 13, and both are
    recorded and reported; timings are CPU wall clock."""
    text = f"""\
name: micro-latency
preset: tiny
base:
  data: {{path: {stdlib_data}}}
  model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, max_seq_len: 32}}
  train: {{batch_size: 4, seq_len: 32, warmup_steps: 2, eval_every: 3, ckpt_every: 3, log_every: 3,
          device: cpu}}
budget: {{tokens: 768, match: iso-token}}   # 6 steps
seeds: {{baseline: [0], variants: [0]}}
baseline: llama
variants:
  decode-branch: {{model.branch.enabled: true}}
eval: {{batches: 2, last_k: 1}}
costs: {{measure: always, prompt: 64, context: 16, steps: 3, batches: [1, 8]}}
"""
    suite_file = write_suite(tmp_path, text)
    out = tmp_path / "out"
    console = recording()
    assert run_compare(args(suite_file, out), console=console) == 0
    rows = latencies(out / DB_NAME)
    assert len(rows) == 6 and all(r.ms > 0 and r.timer == "wall-clock" and r.dtype == "float32" for r in rows)
    assert all(r.device.startswith("cpu (") and r.device.endswith(", 1 thread)") for r in rows)
    assert all(r.max_seq_len == 32 and r.bandwidth is None for r in rows)
    assert {(r.phase, r.batch, r.requested, r.length, r.steps) for r in rows if r.run_id == rows[0].run_id} == {
        ("prefill", 1, 64, 32, latency.PREFILL_REPS), ("decode", 1, 16, 13, 3), ("decode", 8, 16, 13, 3)}
    md = (out / "report.md").read_text()
    assert "CPU wall clock" in md and "not comparable with GPU figures" in md
    assert "[prompt 32]" in md and "[ctx 13]" in md
    assert ("in square brackets): prompt 32 of 64 (max_seq_len 32): llama, decode-branch; decode b1 context 13 of 16 "
            "(max_seq_len 32): llama, decode-branch; decode b8 context 13 of 16 (max_seq_len 32): llama, "
            "decode-branch.") in md
    assert (out / LATENCY_FIGURE[0]).read_bytes().startswith(PNG)
    with ResultStore(out / DB_NAME, create=False) as store:
        data = collect(store)
    assert all(len(s.latency) == 3 for s in data.summaries)
    assert "decode-branch seed 0 latency (cpu (" in console.export_text()

    # The latency the suite stored is the engine's (the same function as archlab bench).
    from archlab.infer.loading import load_for_inference

    model, _, _, _ = load_for_inference(out / RUNS_DIR / rows[0].run_id, "cpu", "auto")
    assert model.cfg.max_seq_len == 32 and str(model.lm_head.weight.dtype) == "torch.float32"
