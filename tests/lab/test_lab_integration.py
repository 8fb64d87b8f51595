"""The lab end to end with the real trainer, cost model and corpus (a micro budget, CPU)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from archlab.lab.cli import run_compare
from archlab.lab.plan import build_plan
from archlab.lab.report import collect
from archlab.lab.display import RUNS_DIR
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, ResultStore
from archlab.lab.suite import load_suite
from archlab.train.trainer import train

MICRO = """\
name: micro
preset: tiny
base:
  model: {vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2}
  train: {batch_size: 4, seq_len: 32, warmup_steps: 2, eval_every: 4, ckpt_every: 5, log_every: 2,
          device: cpu}
budget: {tokens: 1536, match: iso-token}   # 12 steps of 4 x 32
seeds: {baseline: [0, 1], variants: [0]}
baseline: llama
variants:
  attnres: {model.residual.kind: attnres}
  decode-branch: {model.branch.enabled: true}
eval: {batches: 2, last_k: 1}
"""


def test_real_trainer_suite_interrupt_resume_and_report(stdlib_data: Path, tmp_path: Path) -> None:
    suite_file = tmp_path / "micro.yaml"
    suite_file.write_text(MICRO)
    out = tmp_path / "suite"
    overrides = [f"data.path={stdlib_data}"]
    quiet = Console(file=open(os.devnull, "w"))
    plan = build_plan(load_suite(suite_file), out, overrides)  # real archlab.model.accounting.costs
    assert [r.steps for r in plan.runs] == [12] * 4
    assert plan.runs[1].costs["train_flops_per_token"] > 0

    # Interrupt the first run after 5 steps (its checkpoint at step 5), as a kill would.
    with ResultStore(out / DB_NAME) as store:
        first = run_suite(plan, store, list(plan.runs), train_fn=train, console=quiet, stop_after_steps=5)
    first_id = plan.runs[0].run_id
    assert first.interrupted == first_id
    assert (out / RUNS_DIR / first_id / "ckpt" / "latest").read_text().strip() == "step_0000005"

    # `archlab compare` resumes it from there and trains the rest, then writes the report.
    seen: list[tuple[str, str | None]] = []

    def spy(cfg, out_dir, **kw):
        latest = Path(out_dir) / "ckpt" / "latest"
        seen.append((Path(out_dir).name, latest.read_text().strip() if latest.exists() else None))
        return train(cfg, out_dir, **kw)

    ns = argparse.Namespace(suite=str(suite_file), out=out, dry_run=False, overrides=overrides, variants=None,
                            no_resume=False, force=False)
    assert run_compare(ns, train_fn=spy, console=quiet) == 0
    assert seen[0] == (first_id, "step_0000005") and all(c is None for _, c in seen[1:]) and len(seen) == 4
    with ResultStore(out / DB_NAME, create=False) as store:
        rows = {r.run_id: r for r in store.runs()}
        data = collect(store)
    assert all(r.status == "finished" and r.steps == 12 and r.device for r in rows.values())
    assert rows[first_id].attempts == 2
    assert {s.label: len(s.finished) for s in data.summaries} == {"llama": 2, "attnres": 1, "decode-branch": 1}
    assert data.floor is not None and all(s.comparison is not None for s in data.summaries[1:])
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3

    # The resumed run ends exactly where an uninterrupted one does (the trainer is bitwise on CPU).
    clean = tmp_path / "clean"
    clean_plan = build_plan(load_suite(suite_file), clean, overrides)
    with ResultStore(clean / DB_NAME) as store:
        run_suite(clean_plan, store, [clean_plan.runs[0]], train_fn=train, console=quiet)
        assert store.get(first_id).final_val_loss == rows[first_id].final_val_loss
