"""``archlab probe routing``: routing weights over depth, JS divergence between heads, outputs."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from archlab.analysis.probe import collect_routing, probe_routing, summarize, text_token_batches
from archlab.config import make_config
from archlab.model.variants.attnres import ResidualConfig
from archlab.errors import ArchlabError
from archlab.model import build_model
from archlab.model.variants.attnres.module import mean_pairwise_js
from tests.helpers import tiny_model_cfg


def _cli(argv):
    from archlab.analysis.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def _random_routing(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in model.residual.queries:
            q.copy_(3 * torch.randn(q.shape, generator=g))
    return model


def test_js_divergence_values():
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert mean_pairwise_js(p).item() == pytest.approx(1.0)  # disjoint: 1 bit
    assert mean_pairwise_js(torch.tensor([[0.5, 0.5], [0.5, 0.5]])).item() == 0.0
    assert mean_pairwise_js(torch.tensor([[0.2, 0.8]])).item() == 0.0  # one head


def test_probe_cli_on_saved_checkpoint(tmp_path, capsys):
    from archlab.io.checkpoint import save_model

    run = make_config("tiny", overrides=["model.vocab_size=300", "model.n_layers=2", "model.d_model=64",
                                         "model.residual.kind=attnres", "model.residual.heads=4",
                                         "model.branch.enabled=true"])
    torch.manual_seed(0)
    model = _random_routing(build_model(run.model))
    save_model(tmp_path / "ckpt", model, run)  # no tokenizer: the probe falls back to UTF-8 bytes
    out = tmp_path / "probe"
    assert _cli(["probe", "routing", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--batches", "2",
                 "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]) == 0
    assert "depth routing" in capsys.readouterr().out
    summary = json.loads((out / "routing.json").read_text())
    assert (out / "routing_primary.png").stat().st_size > 1000 and (out / "routing_branch.png").is_file()
    assert summary["tokens"] == 64 and "UTF-8" in summary["tokens_from"]
    for stream in ("primary", "branch"):
        sites = summary["streams"][stream]["sites"]
        assert [s["label"] for s in sites] == ["L0.attn", "L0.mlp", "L1.attn", "L1.mlp", "final"]
        for i, s in enumerate(sites):
            w = np.asarray(s["weights"])
            assert w.shape == (i + 1, 4) and len(s["sources"]) == i + 1
            np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-6)  # per head over depth
            assert 0.0 <= s["js_heads"] <= 1.0 and 0.0 <= s["js_heads_per_position"] <= 1.0
        assert sites[0]["weights"] == [[1.0] * 4]
        assert max(s["js_heads"] for s in sites) > 0.01  # random queries: heads disagree
    # the branch rows have their own depth history
    assert summary["streams"]["primary"]["sites"][2]["weights"] != summary["streams"]["branch"]["sites"][2]["weights"]


def test_probe_at_init_is_uniform_and_heads_agree(tmp_path):
    cfg = tiny_model_cfg(n_layers=2, residual=ResidualConfig(kind="attnres", heads=2, blocks=2))
    model = build_model(cfg)
    batches, source = text_token_batches(None, cfg.vocab_size, 2, 2, 8)
    assert all(b.shape == (2, 8) and int(b.max()) < cfg.vocab_size for b in batches)
    summary, paths = probe_routing(model, batches, tmp_path)
    assert all(p.is_file() for p in paths)
    for s in summary["streams"]["primary"]["sites"]:
        np.testing.assert_allclose(s["weights"], 1.0 / s["n_sources"], rtol=1e-6)
        assert s["js_heads"] == pytest.approx(0.0, abs=1e-9)
        assert s["entropy_bits"][0] == pytest.approx(s["max_entropy_bits"], abs=1e-6)
    assert summary["streams"]["primary"]["sites"][3]["sources"] == ["emb", "block1", "block2.partial"]


def test_probe_on_prepared_data_and_delta_model(tmp_path, stdlib_data):
    from archlab.data.loader import TokenData

    base = build_model(tiny_model_cfg(vocab_size=512))
    from archlab.convert.delta import to_delta_mhar

    cfg, sd = to_delta_mhar(base.state_dict(), base.cfg, heads=4)
    delta = build_model(cfg)
    delta.load_state_dict(sd)
    batches = [x for x, _ in TokenData(stdlib_data).val_batches(2, 2, 16)]
    rec = collect_routing(delta, batches)
    summary = summarize(delta, rec)
    sites = summary["streams"]["primary"]["sites"]
    assert sites[0]["sources"] == ["null"] and all(s["gate"] == 0.0 for s in sites)
    assert delta.residual.recorder is None  # recording is switched off afterwards


def test_probe_refuses_standard_model(tmp_path):
    from archlab.io.checkpoint import save_model

    run = make_config("tiny", overrides=["model.vocab_size=300", "model.n_layers=1", "model.d_model=32"])
    save_model(tmp_path / "std", build_model(run.model), run)
    with pytest.raises(ArchlabError, match="attnres or delta"):
        _cli(["probe", "routing", "--ckpt", str(tmp_path / "std"), "--out", str(tmp_path / "o")])


def test_probe_seq_len_beyond_the_models_context_is_one_error(tmp_path):
    # an explicit --seq-len past the context was cut to it silently; the default still fits itself
    from archlab.errors import UsageError
    from archlab.io.checkpoint import save_model

    run = make_config("tiny", overrides=["model.vocab_size=300", "model.n_layers=1", "model.d_model=32",
                                         "model.max_seq_len=64", "train.seq_len=64",
                                         "model.residual.kind=attnres"])
    save_model(tmp_path / "ckpt", build_model(run.model), run)
    base = ["probe", "routing", "--ckpt", str(tmp_path / "ckpt"), "--batches", "1", "--batch-size", "1",
            "--device", "cpu"]
    with pytest.raises(UsageError, match=r"--seq-len must be at most the model's context of 64 tokens, got 65"):
        _cli([*base, "--out", str(tmp_path / "bad"), "--seq-len", "65"])
    assert not (tmp_path / "bad").exists()
    assert _cli([*base, "--out", str(tmp_path / "ok")]) == 0  # default 128, on a 64-token model
    assert json.loads((tmp_path / "ok" / "routing.json").read_text())["seq_len"] == 64
