"""The command line: happy paths, and every bad input gives one line, a non-zero exit and no damage."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli
from tests.conftest import SMALL


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_line_error(code, err, expect_code, *words):
    assert code == expect_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("override,words", [
    ("model.n_layerz=3", ["unknown key 'model.n_layerz'", "n_layers"]),
    ("model.n_layers=three", ["model.n_layers", "expected int"]),
    ("model.n_kv_heads=3", ["model.n_kv_heads", "must divide"]),
    ("train.schedule=linear", ["train.schedule", "'cosine'"]),
    ("model.moe.branch_top_k=3", []),  # harmless while ffn is swiglu: accepted below
])
def test_bad_config_is_one_line_exit_2_and_writes_nothing(override, words, tmp_path, capsys, stdlib_data):
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--out", str(out), "--set", f"data.path={stdlib_data}", "--set", override,
                           "--set", "train.steps=0")
    # train.steps=0 is itself invalid, so even a valid override must stop before writing anything
    assert_one_line_error(code, err, 2, *(words or ["train.steps"]))
    assert not out.exists()


def test_bad_arguments_are_one_line(capsys):
    code, _, err = run_cli(capsys, "train", "--resume", "sometimes")
    assert_one_line_error(code, err, 2, "--resume")
    code, _, err = run_cli(capsys, "frobnicate")
    assert_one_line_error(code, err, 2, "frobnicate")


def test_missing_config_file_and_bad_yaml(tmp_path, capsys):
    code, _, err = run_cli(capsys, "info", "--config", str(tmp_path / "nope.yaml"))
    assert_one_line_error(code, err, 2, "does not exist")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_model: [\n")
    code, _, err = run_cli(capsys, "info", "--config", str(bad))
    assert_one_line_error(code, err, 2, "not valid YAML")


def test_missing_data_directory(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--out", str(out), "--set", f"data.path={tmp_path / 'nodata'}")
    assert_one_line_error(code, err, 1, "nodata")
    assert not out.exists()


def test_eval_generate_info_on_a_trained_run(tiny_run, stdlib_data, capsys):
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(tiny_run), "--batches", "2", "--batch-size", "2")
    assert code == 0, err
    assert "bits/byte" in out
    code, out, err = run_cli(capsys, "generate", "--ckpt", str(tiny_run), "--prompt", "def main(", "--prompt", "import",
                             "--max-new-tokens", "8", "--temperature", "0")
    assert code == 0, err
    assert out.startswith("def main(") and "import" in out
    code, out, err = run_cli(capsys, "info", "--set", "model.branch.enabled=true", "--context", "256")
    assert code == 0, err
    assert "baseline" in out and "prefill FLOPs / token" in out and "1.000x" in out


@pytest.mark.parametrize("damage", ["truncate", "flip", "state"])
def test_damaged_checkpoint_is_reported_and_left_alone(damage, tiny_run, stdlib_data, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    ck = run / "ckpt" / (run / "ckpt" / "latest").read_text().strip()
    weights = ck / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        (ck / "state.json").write_text("{not json")
    before = snapshot(run)
    # the error says where to go: the run's newest checkpoint that still verifies (step 3 of 3, 6)
    intact = [f"the newest intact checkpoint is {run / 'ckpt' / 'step_0000003'}", "--ckpt to eval",
              f"to resume training from it, point {run / 'ckpt' / 'latest'} at it"]
    code, _, err = run_cli(capsys, "eval", "--ckpt", str(run))
    assert_one_line_error(code, err, 1, str(ck), *intact)
    # resuming training into it fails the same way and changes nothing
    sets = [*SMALL, f"data.path={stdlib_data}", "train.steps=12", "train.ckpt_every=3", "train.eval_every=3"]
    code, _, err = run_cli(capsys, "train", "--out", str(run), *sum((["--set", s] for s in sets), []))
    assert_one_line_error(code, err, 1, str(ck), *intact)
    assert snapshot(run) == before


def test_tokenizer_data_mismatch(tiny_run, tmp_path, capsys):
    from archlab.data.prepare import prepare

    other = tmp_path / "other"
    prepare("stdlib", other, vocab_size=300, max_bytes=200_000)
    before = snapshot(tiny_run)
    code, _, err = run_cli(capsys, "eval", "--ckpt", str(tiny_run), "--data", str(other))
    assert_one_line_error(code, err, 1, "tokenizer")
    assert snapshot(tiny_run) == before


def test_data_info(stdlib_data, capsys):
    code, out, err = run_cli(capsys, "data", "info", str(stdlib_data))
    assert code == 0, err
    assert "train" in out and "val" in out


@pytest.mark.parametrize("argv,words", [
    (["generate", "--prompt", "def", "--max-new-tokens", "100000"], ["--max-new-tokens", "context of 256"]),
    (["eval", "--seq-len", "100000"], ["--seq-len", "context of 256"]),
])
def test_arguments_beyond_the_models_context_are_one_line(tiny_run, capsys, argv, words):
    code, _, err = run_cli(capsys, argv[0], "--ckpt", str(tiny_run), *argv[1:])
    assert_one_line_error(code, err, 2, *words)


def test_resuming_says_from_which_step(tiny_run, stdlib_data, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    # the run's own config: it is finished at step 6, so resuming trains nothing and is quick
    sets = [*SMALL, f"data.path={stdlib_data}", "train.steps=6", "train.ckpt_every=3", "train.eval_every=3"]
    code, out, err = run_cli(capsys, "train", "--out", str(run), *sum((["--set", s] for s in sets), []))
    assert code == 0, err
    assert f"resuming from step 6 of {run}" in err + out


# Every numeric argument of the commands this module's parser owns, given a value out of its range
# (or no number at all): argparse's one line, exit 2, naming the argument, before any work.
_BAD_ARGUMENTS = [
    (["eval", "--ckpt", "run", "--batches", "0"], "--batches"),
    (["eval", "--ckpt", "run", "--batches", "two"], "--batches"),
    (["eval", "--ckpt", "run", "--batch-size", "-1"], "--batch-size"),
    (["eval", "--ckpt", "run", "--seq-len", "-5"], "--seq-len"),
    (["eval", "--ckpt", "run", "--tasks", "piqa", "--limit", "0"], "--limit"),
    (["info", "--context", "-1"], "--context"),
    (["info", "--batch", "0"], "--batch"),
    (["info", "--dtype-bytes", "0"], "--dtype-bytes"),
    (["data", "prepare", "--out", "d", "--vocab-size", "100"], "--vocab-size"),
    (["data", "prepare", "--out", "d", "--val-frac", "0"], "--val-frac"),
    (["data", "prepare", "--out", "d", "--val-frac", "1.5"], "--val-frac"),
    (["data", "prepare", "--out", "d", "--max-mb", "-1"], "--max-mb"),
    (["data", "prepare", "--out", "d", "--max-mb", "nan"], "--max-mb"),
    (["data", "prepare", "--out", "d", "--seed", "-1"], "--seed"),
    (["data", "prepare", "--out", "d", "--shard-tokens", "0"], "--shard-tokens"),
    (["compare", "--out", "s", "--jobs", "0"], "--jobs"),
    (["convert", "--to", "delta-mhar", "--ckpt", "run", "--out", "c", "--heads", "0"], "--heads"),
    (["convert", "--to", "delta-mhar", "--ckpt", "run", "--out", "c", "--groups", "-1"], "--groups"),
    (["probe", "routing", "--ckpt", "run", "--out", "p", "--batches", "0"], "--batches"),
    (["probe", "routing", "--ckpt", "run", "--out", "p", "--batch-size", "0"], "--batch-size"),
    (["probe", "routing", "--ckpt", "run", "--out", "p", "--seq-len", "0"], "--seq-len"),
    (["train", "--out", "run", "--set", "train.threads=-1"], "train.threads"),
    (["train", "--out", "run", "--set", "train.beta1=1.5"], "train.beta1"),
    (["train", "--out", "run", "--set", "train.beta2=-0.1"], "train.beta2"),
    (["train", "--out", "run", "--set", "train.weight_decay=-1"], "train.weight_decay"),
    (["train", "--out", "run", "--set", "train.grad_clip=-1"], "train.grad_clip"),
    (["train", "--out", "run", "--set", "train.grad_clip=0"], "train.grad_clip"),
    (["train", "--out", "run", "--set", "train.lr=inf"], "train.lr"),
    (["train", "--out", "run", "--set", "train.seed=-1"], "train.seed"),
    (["train", "--out", "run", "--set", "data.seed=-1"], "data.seed"),
    (["train", "--out", "run", "--set", "model.rope_theta=-1"], "model.rope_theta"),
    (["train", "--out", "run", "--set", "model.init_std=inf"], "model.init_std"),
    (["generate", "--ckpt", "run", "--prompt", "x", "--max-new-tokens", "-5"], "--max-new-tokens"),
    (["generate", "--ckpt", "run", "--prompt", "x", "--top-k", "-3"], "--top-k"),
    (["generate", "--ckpt", "run", "--prompt", "x", "--top-p", "-0.5"], "--top-p"),
    (["generate", "--ckpt", "run", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["serve", "--ckpt", "run", "--port", "70000"], "--port"),
    (["serve", "--ckpt", "run", "--slots", "0"], "--slots"),
    (["bench", "decode", "--steps", "0"], "--steps"),
    (["bench", "decode", "--batches", "1,0"], "--batches"),
]


@pytest.mark.parametrize("argv,name", _BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in _BAD_ARGUMENTS])
def test_numeric_arguments_out_of_range_are_one_line(argv, name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # every default and relative --out would be written here
    code, _, err = run_cli(capsys, *argv)
    assert_one_line_error(code, err, 2, name)
    if name.startswith("--"):
        assert f"argument {name}: must be" in err  # the message says what is allowed
    assert list(tmp_path.iterdir()) == []


OWNED = ["train", "eval", "import-hf", "info", "config", "data", "compare", "report", "convert", "probe", "generate",
         "serve", "bench"]


def _parsers(parser: argparse.ArgumentParser, names=None):
    """``(prog, parser)`` of every (sub)command below ``parser``, limited to ``names`` at the top."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if names is None or name in names:
                    yield sub.prog, sub
                    yield from _parsers(sub)


def test_every_option_has_help():
    from archlab.cli import build_parser

    parsers = dict(_parsers(build_parser(), OWNED))
    assert {"archlab data prepare", "archlab probe routing", "archlab eval"} <= set(parsers)
    missing = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, p in parsers.items()
               for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not (a.help or "").strip()]
    assert missing == []
    train_help = parsers["archlab train"].format_help()
    assert "archlab data prepare" in train_help and "never:" in train_help


@pytest.mark.parametrize("argv", [["train", "--set", "model.n_layerz=3"], ["info", "--set", "model.ffn=gelu"]])
def test_config_errors_do_not_import_torch(argv):
    # torch takes seconds to import; a config error must not wait for it
    code = ("import sys; from archlab.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert "config error" in proc.stderr


@pytest.mark.parametrize("argv", [["compare", "--set", "train.lr=abc"],
                                  ["compare", "--set", "model.n_layerz=3", "--dry-run"]])
def test_compare_config_errors_import_neither_torch_nor_the_report(argv, tmp_path):
    # the report's scipy and matplotlib took a second to import before the suite was read
    code = ("import sys; from archlab.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, *(m in sys.modules for m in ('torch', 'scipy', 'matplotlib')))")
    proc = subprocess.run([sys.executable, "-c", code, *argv, "--out", str(tmp_path / "suite")],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert proc.stdout.split() == ["2", "False", "False", "False"], proc.stdout + proc.stderr
    assert "config error" in proc.stderr and list(tmp_path.iterdir()) == []


def test_argtypes_for_generate_sampling(capsys):
    # the types the generate command is to use (its module is not this one's): boundaries included
    from archlab.argtypes import int_at_least, non_negative_float, positive_int, unit_float
    from archlab.cli import _Parser

    p = _Parser(prog="archlab generate")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=non_negative_float, default=0.8)
    p.add_argument("--top-k", type=int_at_least(0, "0 = off"), default=50)
    p.add_argument("--top-p", type=unit_float, default=0.95)
    ok = p.parse_args(["--max-new-tokens", "1", "--temperature", "0", "--top-k", "0", "--top-p", "1"])
    assert (ok.max_new_tokens, ok.temperature, ok.top_k, ok.top_p) == (1, 0.0, 0, 1.0)
    for argv, allowed in [(["--max-new-tokens", "-5"], "at least 1"), (["--top-k", "-3"], "at least 0"),
                          (["--top-p", "-0.5"], "in (0, 1]"), (["--top-p", "0"], "in (0, 1]"),
                          (["--temperature", "-1"], "at least 0"), (["--temperature", "inf"], "at least 0")]:
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"argument {argv[0]}: must be" in err and allowed in err, err


def test_info_per_layer_shows_the_width_schedule(capsys):
    code, out, err = run_cli(capsys, "info", "--preset", "124m", "--set", "model.width=variable", "--per-layer",
                             "--json")
    assert code == 0, err
    got = json.loads(out)
    widths = [r["width"] for r in got["this config"]["layers"]]
    assert widths[0] == widths[-1] > min(widths) and len(set(r["width"] for r in got["baseline"]["layers"])) == 1
    assert sum(r["kv_bytes_per_token"] for r in got["this config"]["layers"]) == got["this config"]["kv_bytes_per_token"]
    assert got["this config"]["kv_bytes_per_token"] < got["baseline"]["kv_bytes_per_token"]


def test_out_of_gpu_memory_is_one_line_and_any_other_error_keeps_its_traceback(capsys, monkeypatch, tmp_path):
    """torch.OutOfMemoryError (matched by name: the CLI must not import torch to catch it) is a
    resource limit the user sets, so one line with what to change; a bug still raises."""
    import archlab.train.trainer as trainer

    class OutOfMemoryError(RuntimeError):
        pass

    def out_of_memory(*args, **kwargs):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "train", out_of_memory)
    code, out, err = run_cli(capsys, "train", "--out", str(tmp_path / "run"))
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("archlab: out of GPU memory; the last checkpoint is kept: lower train.batch_size")

    def bug(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(trainer, "train", bug)
    with pytest.raises(KeyError):
        run_cli(capsys, "train", "--out", str(tmp_path / "run"))
