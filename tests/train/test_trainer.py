"""The trainer: learning, exact resume, divergence handling, schedules."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from archlab.config import make_config
from archlab.io.temporaries import temporary_path
from archlab.errors import ArchlabError, CheckpointError, ConfigError, TrainingDiverged
from archlab.train import trainer as trainer_mod
from archlab.train.trainer import lr_at, train
from tests.conftest import small_config


def _losses(run_dir):
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]


def test_resume_reproduces_uninterrupted_run_exactly(stdlib_data, tmp_path):
    extra = ("train.steps=8", "train.ckpt_every=4", "train.eval_every=4", "train.log_every=1")
    cfg = small_config(stdlib_data, *extra)
    full = train(cfg, tmp_path / "full", show_progress=False)
    first = train(cfg, tmp_path / "split", stop_after_steps=4, show_progress=False)
    assert first.steps == 4
    # metrics written after the checkpoint (an interrupted run's tail) are dropped on resume
    second = train(cfg, tmp_path / "split", show_progress=False)
    assert second.steps == 8
    assert _losses(tmp_path / "full") == _losses(tmp_path / "split")
    assert [v["loss"] for v in full.val_curve] == [v["loss"] for v in second.val_curve]


def test_a_torn_last_metrics_record_is_dropped_on_resume(stdlib_data, tmp_path, capsys):
    cfg = small_config(stdlib_data, "train.steps=4", "train.ckpt_every=2", "train.eval_every=2", "train.log_every=1")
    out = tmp_path / "run"
    train(cfg, out, stop_after_steps=3, show_progress=False)  # checkpoint at 2, logged up to 3
    log = out / "metrics.jsonl"
    lines = log.read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 3
    log.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    # ... which also leaves the temporaries it was writing; starting again removes them
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = [temporary_path(out / "metrics.jsonl", "tmp", pid=int(dead.stdout)),
             temporary_path(out / "ckpt" / "step_0000004", "tmp", pid=int(dead.stdout))]
    stale[0].write_text("partial")
    stale[1].mkdir()
    capsys.readouterr()
    res = train(cfg, out, show_progress=False)
    err = capsys.readouterr().err
    assert f"resuming from step 2 of {out}" in err
    assert "dropped a torn last record" in err and str(log) in err
    assert res.steps == 4
    assert not any(p.exists() for p in stale)
    # one clean curve: every record parses, the kept ones unchanged, step 3 recomputed exactly
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in recs] == [("train", 1), ("train", 2), ("val", 2), ("train", 3),
                                                      ("train", 4), ("val", 4), ("final", 4)]
    assert log.read_text().splitlines()[:3] == lines[:3]
    assert recs[3]["loss"] == json.loads(lines[3])["loss"]
    assert [v["step"] for v in res.val_curve] == [2, 4]


def test_a_corrupt_metrics_line_before_the_last_is_one_error(tiny_run, stdlib_data, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    log = out / "metrics.jsonl"
    lines = log.read_text().splitlines()
    lines[1] = lines[1][:10]
    log.write_text("\n".join(lines) + "\n")
    cfg = small_config(stdlib_data, "train.steps=6", "train.ckpt_every=3", "train.eval_every=3")
    with pytest.raises(ArchlabError, match=f"{log} line 2 is not a metrics record") as e:
        train(cfg, out, show_progress=False)
    assert "\n" not in str(e.value)
    assert log.read_text() == "\n".join(lines) + "\n"  # left as it was, for the user to repair


def test_resume_with_a_different_config_names_the_keys_and_advice_that_works(stdlib_data, tmp_path, capsys):
    """The refusal lists the keys that differ (a few, then how many more) and suggests only what
    works: another --out, or the run's own config; never --resume never, which a directory
    holding a checkpoint refuses too."""
    from tests.helpers import run_cli

    out = tmp_path / "r"
    train(small_config(stdlib_data, "train.steps=2"), out, show_progress=False)  # finished
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(CheckpointError) as e:
        train(small_config(stdlib_data, "train.steps=2", "train.lr=0.01"), out, show_progress=False)
    message = str(e.value)
    assert "\n" not in message and "--resume never" not in message
    assert f"{out} holds a run with another config (train.lr: 0.003 -> 0.01); to train this config, train it " \
           f"into another --out; to continue that run: archlab train --config {out / 'config.yaml'} --out {out}" \
           == message
    many = ("train.lr=0.01", "train.beta1=0.8", "train.beta2=0.9", "train.weight_decay=0.2", "model.d_model=64")
    with pytest.raises(CheckpointError, match=r"\(model.d_model: 32 -> 64, train.lr: 0.003 -> 0.01, "
                                              r"train.weight_decay: 0.1 -> 0.2 and 2 more\)"):
        train(small_config(stdlib_data, "train.steps=2", *many), out, show_progress=False)
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == files

    code, stdout, err = run_cli(capsys, "train", "--config", str(out / "config.yaml"), "--out", str(out))
    assert code == 0 and f"resuming from step 2 of {out}" in err and "done: 2 steps" in stdout, err
    code, stdout, err = run_cli(capsys, "train", "--config", str(out / "config.yaml"), "--out", str(out),
                                "--resume", "never")
    assert code == 1 and err.count("\n") == 1 and "already holds a checkpoint" in err
    assert "another --out" in err and "--resume never" not in err


def test_tiny_preset_learns_well_below_unigram_entropy(tmp_path):
    """The tiny preset, unchanged, with its default budget on the default stdlib corpus."""
    from archlab.data.prepare import prepare

    data = tmp_path / "stdlib"
    prepare("stdlib", data, vocab_size=4096)
    cfg = make_config("tiny", overrides=[f"data.path={data}"])
    res = train(cfg, tmp_path / "tiny", show_progress=False)
    val = np.fromfile(data / "val_000.bin", dtype=np.uint16)
    counts = np.bincount(val, minlength=4096).astype(float)
    p = counts[counts > 0] / counts.sum()
    unigram = float(-(p * np.log(p)).sum())
    assert res.steps == cfg.train.steps
    # one nat below the unigram entropy is 1.44 bits per token of real modelling
    assert res.final_val_loss < unigram - 1.0, (res.final_val_loss, unigram)
    assert math.isfinite(res.final_val_bpb) and res.final_val_bpb > 0


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(stdlib_data, tmp_path, monkeypatch):
    real = trainer_mod.Run.train_step

    def poisoned(self, step):
        loss = real(self, step)
        return float("nan") if step == 4 else loss

    monkeypatch.setattr(trainer_mod.Run, "train_step", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(TrainingDiverged, match="step 4"):
        train(small_config(stdlib_data, "train.steps=8", "train.ckpt_every=2"), out, show_progress=False)
    assert (out / "ckpt" / "latest").read_text().strip() == "step_0000004"
    assert not (out / "ckpt" / "step_0000005").exists()


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_schedules(schedule):
    tc = make_config("tiny", overrides=[f"train.schedule={schedule}", "train.steps=100", "train.warmup_steps=10",
                                        "train.lr=1.0", "train.min_lr_ratio=0.1", "train.decay_frac=0.2"]).train
    lrs = [lr_at(s, tc) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    if schedule == "constant":
        assert lrs[-1] == 1.0
    elif schedule == "cosine":
        assert lrs[-1] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    else:  # stable until the last 20% of steps, then linear decay to the floor
        assert lrs[79] == 1.0 and lrs[80] == 1.0 and lrs[99] == pytest.approx(0.1 + 0.9 / 20)


@pytest.mark.parametrize("steps", [400, 4000])
def test_the_default_warmup_is_a_fraction_of_the_run(steps):
    """A 400-step run and a 4000-step run warm up over the same 5% of their steps; the presets'
    former fixed warm-up is still there by name (`train.warmup_steps=preset`), and recorded."""
    tc = make_config("20m", overrides=[f"train.steps={steps}"]).train
    assert tc.warmup_steps is None and tc.warmup == round(0.05 * steps)
    lrs = [lr_at(s, tc) for s in range(steps)]
    assert lrs[tc.warmup - 1] == pytest.approx(tc.lr) and lrs[tc.warmup - 2] < tc.lr
    assert "warm-up 5% of the steps" in tc.schedule_text()
    fixed = make_config("20m", overrides=[f"train.steps={steps}", "train.warmup_steps=preset"]).train
    assert fixed.warmup == fixed.warmup_steps == 200 and "fixed warm-up of 200 steps" in fixed.schedule_text()
    assert make_config("20m", overrides=[f"train.steps={steps}", "train.warmup_steps=preset"]).to_dict()[
        "train"]["warmup_steps"] == 200  # the number is what the run records
    with pytest.raises(ConfigError, match="train.warmup_steps: 'preset' names a preset's fixed warm-up"):
        make_config(None, overrides=["train.warmup_steps=preset"])
    with pytest.raises(ConfigError, match=r"train.warmup_frac: must be in \[0, 1\)"):
        make_config("tiny", overrides=["train.warmup_frac=1"])


def test_a_preset_run_shorter_than_its_former_warmup_is_accepted(stdlib_data, tmp_path, capsys):
    """`--set train.steps=2` on a preset trains (the warm-up is a fraction of the run); a fixed
    warm-up given longer than the run is still one line, exit 2, nothing written."""
    from tests.conftest import SMALL
    from tests.helpers import run_cli

    code, out, err = run_cli(capsys, "config", "--preset", "20m", "--set", "train.steps=2")
    assert code == 0 and "steps: 2" in out and "warmup_steps: null" in out, err
    sets = [a for o in SMALL if not o.startswith("train.warmup_steps") for a in ("--set", o)]
    sets += ["--set", f"data.path={stdlib_data}", "--set", "train.steps=2"]
    code, out, err = run_cli(capsys, "train", "--preset", "tiny", *sets, "--out", str(tmp_path / "ok"))
    assert code == 0 and "done: 2 steps" in out, err
    code, out, err = run_cli(capsys, "train", "--preset", "tiny", *sets, "--set", "train.warmup_steps=5",
                             "--out", str(tmp_path / "refused"))
    assert code == 2 and out == "" and err.count("\n") == 1 and "train.warmup_steps: must be in 0..steps=2" in err
    assert not (tmp_path / "refused").exists()


def test_the_final_loss_is_the_saved_final_weights_on_the_final_sample(stdlib_data, tmp_path):
    """Training ends with one evaluation of the final weights on the final sample (the val split's
    first windows up to train.final_eval_tokens); evaluating the saved final checkpoint on that
    sample gives the same number to the last digit (CPU), and `archlab eval --final` prints it."""
    from archlab.eval.corpus import evaluate_checkpoint_on

    cfg = small_config(stdlib_data, "train.steps=6", "train.eval_every=3", "train.final_eval_tokens=1000")
    res = train(cfg, tmp_path / "run", show_progress=False)
    final = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "final"]
    assert len(final) == 1 and final[0]["step"] == 6
    assert final[0]["val_tokens"] == res.final_val_tokens == 8 * 4 * 32  # 1000 tokens: 8 batches of 4 x 32
    direct = evaluate_checkpoint_on(None, tmp_path / "run", final=True)
    assert (direct["loss"], direct["bpb"], direct["tokens"]) == (res.final_val_loss, res.final_val_bpb, 1024)
    assert res.final_val_se is not None and direct["se"] == res.final_val_se and 0 < res.final_val_se < 1
    # the per-batch losses travel with it (for paired sampling errors between runs)
    assert len(res.final_val_batches) == 8 and [t for _, t in res.final_val_batches] == [128] * 8
    assert sum(n for n, _ in res.final_val_batches) / 1024 == pytest.approx(res.final_val_loss, rel=1e-12)
    # the curve's last evaluation is of the same weights but on its own smaller sample (2 batches)
    assert res.val_curve[-1]["step"] == 6 and res.val_curve[-1]["val_tokens"] == 2 * 4 * 32
    assert res.val_curve[-1]["loss"] != res.final_val_loss
    # resuming the finished run evaluates nothing again and returns the recorded final loss
    again = train(cfg, tmp_path / "run", show_progress=False)
    assert (again.final_val_loss, again.final_val_tokens) == (res.final_val_loss, res.final_val_tokens)
    assert sum(json.loads(line)["kind"] == "final"
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    out = subprocess.run([sys.executable, "-m", "archlab.cli", "eval", "--ckpt", str(tmp_path / "run"), "--final",
                          "--json"], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["loss"] == res.final_val_loss


def test_sampling_se_by_hand():
    from archlab.eval.sample_error import paired_sampling_se, sampling_se

    # two models on the same batches: the error of the difference, from the per-batch differences
    a, b = [[4.0 * 10, 10], [6.0 * 10, 10], [5.0 * 10, 10]], [[3.9 * 10, 10], [5.8 * 10, 10], [5.0 * 10, 10]]
    d = [0.1, 0.2, 0.0]  # per-batch loss differences; mean 0.1
    hand = math.sqrt(3 / 2 * sum((x - 0.1) ** 2 * 100 for x in d)) / 30
    assert paired_sampling_se(a, b) == pytest.approx(hand)
    assert paired_sampling_se(a, b[:2]) is None and paired_sampling_se(a, [[1.0, 9]] + b[1:]) is None

    # batch losses 2, 4 (equal weights): mean 3; ratio estimator sqrt(2/1 * (1^2 + 1^2) * w^2) / (2w) = 1
    assert sampling_se([2.0 * 10, 4.0 * 10], [10, 10]) == pytest.approx(1.0)
    assert sampling_se([5.0], [2]) is None
    # unequal weights: the token-weighted mean, each batch weighted by its tokens
    nats, tok = [1.0 * 3, 2.0 * 1], [3, 1]
    mean = sum(nats) / sum(tok)
    hand = math.sqrt(2 / 1 * sum((a - mean * w) ** 2 for a, w in zip(nats, tok))) / sum(tok)
    assert sampling_se(nats, tok) == pytest.approx(hand)


# ---- train.cuda_graph --------------------------------------------------------------------------
def test_cuda_graph_needs_cuda(stdlib_data, tmp_path):
    """On CPU the option fails at start, with one line, before anything is written."""
    cfg = small_config(stdlib_data, "train.cuda_graph=true", "train.device=cpu")
    with pytest.raises(ConfigError, match="train.cuda_graph needs a CUDA device"):
        train(cfg, tmp_path / "r", show_progress=False)
    assert not (tmp_path / "r").exists()


def test_checkpoint_holds_a_device_tensor_learning_rate_as_a_number():
    """With the graph, AdamW's rate is a tensor; the checkpoint's JSON state holds its value."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=torch.tensor(0.25))
    p.grad = torch.ones(3)
    opt.step()
    tensors, meta = trainer_mod.optimizer_tensors(opt)
    assert json.loads(json.dumps(meta))["param_groups"][0]["lr"] == 0.25
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=1.0)
    trainer_mod._load_optim(fresh, tensors, meta)
    assert fresh.param_groups[0]["lr"] == 0.25


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("residual", [(), ("model.residual.kind=attnres",),
                                      ("model.residual.kind=attnres", "model.residual.blocks=2",
                                       "model.residual.heads=2")],
                         ids=["standard", "attnres", "block-mhar"])
def test_cuda_graph_step_matches_the_ordinary_step(stdlib_data, tmp_path, residual):
    """Replayed steps follow the ordinary steps' loss curve, past the warm-up and the capture.

    Block MHAR routes its partial sums as the kernels' tail operand, tensors the graph allocates
    and replays like any other intermediate."""
    extra = ("train.steps=9", "train.log_every=1", "train.eval_every=9", "train.ckpt_every=9",
             "train.device=cuda", *residual)
    curves = {}
    for graph in (False, True):
        out = tmp_path / f"graph{graph}"
        train(small_config(stdlib_data, *extra, f"train.cuda_graph={str(graph).lower()}"), out,
              show_progress=False)
        curves[graph] = _losses(out)
    assert [s for s, _ in curves[True]] == list(range(1, 10))
    # The graph's AdamW reads a float32 rate from a tensor; the ordinary step a Python float.
    np.testing.assert_allclose([l for _, l in curves[True]], [l for _, l in curves[False]], rtol=1e-3)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_at_the_current_step_and_resume_is_exact(stdlib_data, tmp_path, monkeypatch,
                                                                              capsys, signum):
    extra = ("train.steps=8", "train.ckpt_every=4", "train.eval_every=4", "train.log_every=1")
    cfg = small_config(stdlib_data, *extra)
    train(cfg, tmp_path / "full", show_progress=False)
    out = tmp_path / "split"
    real_step = trainer_mod.Run.train_step

    def step_then_signal(self, step):
        loss = real_step(self, step)
        if step == 4:  # during the 5th step, between the ckpt_every checkpoints at 4 and 8
            os.kill(os.getpid(), signum)
        return loss

    monkeypatch.setattr(trainer_mod.Run, "train_step", step_then_signal)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out, show_progress=False)
    assert (out / "ckpt" / "latest").read_text().strip() == "step_0000005"
    assert "at step 5 of 8: checkpoint saved" in capsys.readouterr().err
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # the handlers are put back
    monkeypatch.setattr(trainer_mod.Run, "train_step", real_step)
    res = train(cfg, out, show_progress=False)
    assert "resuming from step 5" in capsys.readouterr().err
    assert res.steps == 8
    assert _losses(tmp_path / "full") == _losses(out)


def test_a_second_signal_stops_at_once_without_a_checkpoint(stdlib_data, tmp_path, monkeypatch):
    cfg = small_config(stdlib_data, "train.steps=8", "train.ckpt_every=4", "train.eval_every=4")
    real_step = trainer_mod.Run.train_step

    def step_then_two_signals(self, step):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # raises here, inside the step
        return real_step(self, step)

    monkeypatch.setattr(trainer_mod.Run, "train_step", step_then_two_signals)
    monkeypatch.setattr(trainer_mod._StopRequest, "SAME_REQUEST_S", 0.0)  # as if seconds apart
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", show_progress=False)
    assert (tmp_path / "run" / "ckpt" / "latest").read_text().strip() == "step_0000004"


def test_one_stop_delivered_twice_still_saves(stdlib_data, tmp_path, monkeypatch, capsys):
    """Ctrl-C reaches a compare worker through the process group and again as compare's SIGTERM,
    a moment apart: that is one request, and the run saves its step."""
    cfg = small_config(stdlib_data, "train.steps=8", "train.ckpt_every=4", "train.eval_every=4")
    real_step = trainer_mod.Run.train_step

    def step_then_group_and_forwarded_signal(self, step):
        loss = real_step(self, step)
        if step == 5:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    monkeypatch.setattr(trainer_mod.Run, "train_step", step_then_group_and_forwarded_signal)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", show_progress=False)
    assert (tmp_path / "run" / "ckpt" / "latest").read_text().strip() == "step_0000006"
    assert "at step 6 of 8: checkpoint saved" in capsys.readouterr().err


def test_a_signal_before_the_first_step_ends_stops_at_once(stdlib_data, tmp_path, monkeypatch):
    """A run stopped while its process is still in its first step (compiling, capturing a graph)
    has nothing new to save: it leaves at once instead of finishing a step that may take minutes,
    and the checkpoint it resumed from stays the latest."""
    cfg = small_config(stdlib_data, "train.steps=8", "train.ckpt_every=4", "train.eval_every=4")
    out = tmp_path / "run"
    train(cfg, out, show_progress=False, stop_after_steps=4)
    real_step = trainer_mod.Run.train_step
    finished = []

    def signal_inside_the_first_step(self, step):
        os.kill(os.getpid(), signal.SIGTERM)  # raises here, before the step runs
        finished.append(step)
        return real_step(self, step)

    monkeypatch.setattr(trainer_mod.Run, "train_step", signal_inside_the_first_step)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out, show_progress=False)
    assert finished == []
    assert (out / "ckpt" / "latest").read_text().strip() == "step_0000004"
    assert signal.getsignal(signal.SIGTERM) in (signal.default_int_handler, signal.SIG_DFL)


def test_a_signal_the_process_ignores_stays_ignored(stdlib_data, tmp_path, monkeypatch):
    """Started with SIGTERM ignored (as `nohup` or a script's `cmd &` does for a signal), training
    neither takes the signal over nor stops on it, and leaves it ignored."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        real_step = trainer_mod.Run.train_step
        seen = []

        def step_then_signal(self, step):
            loss = real_step(self, step)
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            seen.append(signal.getsignal(signal.SIGTERM))
            return loss

        monkeypatch.setattr(trainer_mod.Run, "train_step", step_then_signal)
        res = train(small_config(stdlib_data, "train.steps=4"), tmp_path / "run", show_progress=False)
        assert res.steps == 4 and seen == [signal.SIG_IGN] * 4
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
