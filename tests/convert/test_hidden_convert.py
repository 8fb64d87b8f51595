"""Conversion to Hidden Decoding: the original's loss at step 0, then continued training (in
process, and through ``archlab train --init-from``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from archlab.config import make_config
from archlab.convert.hidden import EXACT_TOLERANCE, to_hidden
from archlab.errors import ArchlabError, ConfigError, UsageError
from archlab.model import build_model
from tests.helpers import tiny_model_cfg

VOCAB = 512


@pytest.fixture(scope="module")
def real_tokens(stdlib_data):
    from archlab.data.loader import TokenData

    x, y = TokenData(stdlib_data).val_batches(1, 4, 48)[0]
    return x, y


@pytest.fixture(scope="module")
def trained_base(real_tokens):
    """A baseline trained a little, so that its predictions are not the near-uniform ones of an
    initialisation (a conversion that broke them would show)."""
    torch.manual_seed(0)
    base = build_model(tiny_model_cfg(n_layers=4, vocab_size=VOCAB))
    opt = torch.optim.AdamW(base.parameters(), lr=1e-2, weight_decay=0.0)
    x, y = real_tokens
    for _ in range(10):
        opt.zero_grad()
        base(x, y).loss.backward()
        opt.step()
    return base.eval()


def convert(base, streams, mix_layers=None):
    cfg, sd = to_hidden(base.state_dict(), base.cfg, streams, mix_layers)
    model = build_model(cfg).eval()
    model.load_state_dict(sd, strict=True)
    return model


@pytest.mark.parametrize("streams", [2, 4])
def test_converted_model_starts_at_the_originals_loss(streams, trained_base, real_tokens):
    """One mixing layer (the default): the same function, so the loss agrees to float32 rounding
    (the scored stream's softmax over n copies of each key sums in another order)."""
    x, y = real_tokens
    model = convert(trained_base, streams)
    assert model.cfg.hidden_decoding.mixing(4) == {2}
    with torch.no_grad():
        base_loss, loss = trained_base(x, y).loss.item(), model(x, y).loss.item()
        diff = (trained_base.log_probs(trained_base(x)) - model.log_probs(model(x))).abs().max().item()
    assert base_loss < 5.5  # trained: well below log(512) = 6.24
    assert abs(loss - base_loss) < 1e-5 and diff < EXACT_TOLERANCE


def test_more_mixing_layers_start_near_but_not_at_the_original(trained_base, real_tokens):
    """A second mixing layer reads hidden streams that the first one made differ: not exact,
    which is why the default has one (the tolerance above can fail)."""
    x, y = real_tokens
    model = convert(trained_base, 3, mix_layers=[1, 3])
    with torch.no_grad():
        base_loss, loss = trained_base(x, y).loss.item(), model(x, y).loss.item()
    assert 1e-5 < abs(loss - base_loss) < 0.5


def test_conversion_copies_every_tensor_and_the_table():
    base = build_model(tiny_model_cfg())
    sd = base.state_dict()
    cfg, new_sd = to_hidden(sd, base.cfg, 3)
    assert cfg.hidden_decoding.enabled and cfg.hidden_decoding.streams == 3
    assert not base.cfg.hidden_decoding.enabled  # the input config is not modified
    assert set(new_sd) - set(sd) == {"stream_emb.weight"}
    assert all(new_sd[k] is v for k, v in sd.items())
    table = sd["tok_emb.weight"]
    assert torch.equal(new_sd["stream_emb.weight"], torch.cat([table, table]))


def test_conversion_refuses_bad_inputs():
    branch_cfg = tiny_model_cfg()
    branch_cfg.branch.enabled = True
    branch = build_model(branch_cfg)
    with pytest.raises(ConfigError, match="one row per token"):
        to_hidden(branch.state_dict(), branch.cfg, 2)
    base = build_model(tiny_model_cfg())
    with pytest.raises(ConfigError, match="mix_layers"):
        to_hidden(base.state_dict(), base.cfg, 2, mix_layers=[5])
    hidden = convert(base, 2)
    with pytest.raises(ConfigError, match="one row per token"):  # converting twice
        to_hidden(hidden.state_dict(), hidden.cfg, 2)


def test_converted_model_trains_on(trained_base, real_tokens):
    x, y = real_tokens
    model = convert(trained_base, 2).train()
    start = model.stream_emb.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(4):
        loss = model(x, y).loss
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(model.stream_emb.weight.detach(), start)  # the hidden stream learns


# ---- the CLI -------------------------------------------------------------------------------------
def _cli(argv):
    from archlab.analysis.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_convert_cli_round_trip(tmp_path, stdlib_data, real_tokens, capsys):
    from archlab.io.checkpoint import load_model, save_model

    run = make_config("tiny", overrides=[f"model.vocab_size={VOCAB}", "model.n_layers=2", "model.d_model=64"])
    torch.manual_seed(3)
    base = build_model(run.model).eval()
    save_model(tmp_path / "base", base, run, tokenizer_path=stdlib_data / "tokenizer.json")
    out = tmp_path / "hidden"
    assert _cli(["convert", "--to", "hidden", "--streams", "3", "--ckpt", str(tmp_path / "base"),
                 "--out", str(out)]) == 0
    assert "hidden: 3 streams" in " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    model, cfg, ckpt = load_model(out)
    assert cfg.model.hidden_decoding.streams == 3 and (ckpt / "tokenizer.json").is_file()
    x, y = real_tokens
    with torch.no_grad():
        assert abs(model.eval()(x, y).loss.item() - base(x, y).loss.item()) < 1e-5
    with pytest.raises(ArchlabError, match="one row per token"):  # converting twice
        _cli(["convert", "--to", "hidden", "--ckpt", str(out), "--out", str(tmp_path / "again")])
    with pytest.raises(ArchlabError, match="exists"):
        _cli(["convert", "--to", "hidden", "--ckpt", str(tmp_path / "base"), "--out", str(out)])
    with pytest.raises(UsageError, match="--streams"):
        _cli(["convert", "--to", "delta-mhar", "--streams", "2", "--ckpt", str(tmp_path / "base"),
              "--out", str(tmp_path / "delta")])
    with pytest.raises(SystemExit) as e:  # argparse: one line, exit code 2
        _cli(["convert", "--to", "hidden", "--streams", "1", "--ckpt", str(tmp_path / "base"),
              "--out", str(tmp_path / "one")])
    assert e.value.code == 2 and "--streams" in capsys.readouterr().err


def test_a_converted_checkpoint_trains_on_through_the_command_line(tmp_path, stdlib_data, capsys):
    """The paper's setting: a trained model converted, then trained on with ``--init-from``; the
    run starts from the conversion's function (its first logged loss is the original's loss on
    that batch, up to float rounding, since the conversion is exact) and trains."""
    import json

    from archlab.convert.hidden import convert_checkpoint
    from tests.conftest import SMALL
    from tests.helpers import run_cli

    sets = [a for o in [*SMALL, f"data.path={stdlib_data}", "train.log_every=1"] for a in ("--set", o)]
    base = tmp_path / "base"
    assert run_cli(capsys, "train", "--preset", "tiny", *sets, "--set", "train.steps=6", "--out", str(base))[0] == 0
    convert_checkpoint(base, tmp_path / "hidden", streams=2)
    runs = {}
    for name, start in (("plain", base), ("hidden", tmp_path / "hidden")):
        runs[name] = tmp_path / f"{name}-on"
        code, _, err = run_cli(capsys, "train", "--preset", "tiny", *sets, "--set", "train.steps=2",
                               "--init-from", str(start), "--out", str(runs[name]))
        assert code == 0, err
    first = {name: next(json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                        if json.loads(line)["kind"] == "train") for name, out in runs.items()}
    assert first["hidden"] == pytest.approx(first["plain"], abs=1e-4)
