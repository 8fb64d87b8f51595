"""Delta conversion (spec section 2, "Delta AttnRes"): exact identity at step 0, then trainable."""

from __future__ import annotations

import argparse

import pytest
import torch

from archlab.config import make_config
from archlab.model.variants.attnres import ResidualConfig
from archlab.errors import ArchlabError, ConfigError
from archlab.model import build_model
from archlab.model.variants.attnres.module import block_bounds
from archlab.convert.delta import new_parameter_names, to_delta_mhar
from tests.helpers import tiny_model_cfg


def convert(base, heads=4, groups=0):
    cfg, sd = to_delta_mhar(base.state_dict(), base.cfg, heads=heads, groups=groups)
    model = build_model(cfg)
    model.load_state_dict(sd, strict=True)
    return model


@pytest.fixture(scope="module")
def real_tokens(stdlib_data):
    from archlab.data.loader import TokenData

    x, y = TokenData(stdlib_data).val_batches(1, 4, 48)[0]
    return x, y


@pytest.mark.parametrize("heads,groups,branch", [(4, 0, False), (1, 3, False), (8, 4, True)])
def test_converted_logits_equal_original_exactly(heads, groups, branch, real_tokens):
    torch.manual_seed(0)
    cfg = tiny_model_cfg(n_layers=3, vocab_size=512)
    cfg.branch.enabled = branch
    base = build_model(cfg).eval()
    delta = convert(base, heads, groups).eval()
    assert delta.cfg.residual.kind == "delta" and base.cfg.residual.kind == "standard"
    rand = torch.randint(0, 512, (3, 40))
    with torch.no_grad():
        for idx in (rand, real_tokens[0]):
            a, b = base(idx), delta(idx)
            assert (a.logits - b.logits).abs().max().item() == 0.0
            if branch:
                assert (a.extra_logits - b.extra_logits).abs().max().item() == 0.0


def test_conversion_copies_every_baseline_tensor():
    base = build_model(tiny_model_cfg())
    sd = base.state_dict()
    new_cfg, new_sd = to_delta_mhar(sd, base.cfg, heads=2, groups=0)
    assert new_cfg.residual == ResidualConfig(kind="delta", heads=2, delta_groups=0)
    assert base.cfg.residual.kind == "standard"  # the input config is not modified
    added = set(new_sd) - set(sd)
    assert added == set(new_parameter_names(new_cfg))
    assert all(torch.equal(new_sd[k], v) for k, v in sd.items())
    assert torch.equal(new_sd["residual.gates"], torch.zeros(5))
    assert all(bool((new_sd[k] == 1).all()) for k in added if ".gains." in k)
    assert all(bool((new_sd[k] == 0).all()) for k in added if ".queries." in k or k.endswith("null"))


def test_conversion_rejects_bad_inputs():
    attn = build_model(tiny_model_cfg(residual=ResidualConfig(kind="attnres")))
    with pytest.raises(ConfigError, match="standard-residual"):
        to_delta_mhar(attn.state_dict(), attn.cfg)
    base = build_model(tiny_model_cfg())
    with pytest.raises(ConfigError, match="heads"):
        to_delta_mhar(base.state_dict(), base.cfg, heads=5)  # does not divide d_model=32
    with pytest.raises(ConfigError, match="delta_groups"):
        to_delta_mhar(base.state_dict(), base.cfg, groups=9)


def test_training_moves_gates_and_stays_finite(real_tokens):
    torch.manual_seed(1)
    base = build_model(tiny_model_cfg(n_layers=3, vocab_size=512))
    delta = convert(base)
    opt = torch.optim.AdamW(delta.parameters(), lr=3e-3, weight_decay=0.0)
    x, y = real_tokens
    losses = []
    for _ in range(5):
        loss = delta(x, y).loss
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    r = delta.residual
    assert (r.gates.detach().abs() > 0).all()
    assert any(q.detach().abs().sum() > 0 for q in r.queries)  # routing starts to learn once g != 0
    with torch.no_grad():
        assert torch.isfinite(delta(x, y).loss)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("n_layers,groups", [(3, 3), (3, 4), (3, 0), (2, 4)])
def test_group_delta_is_the_sum_of_its_outputs(n_layers, groups):
    """Captured with a hook on ``write``: every delta source is the plain sum of its group's
    sublayer outputs (the public reference code's ``partial - previous_partial`` would give
    alternating sums from the third group on)."""
    torch.manual_seed(2)
    base = build_model(tiny_model_cfg(n_layers=n_layers))
    delta = convert(base, heads=4, groups=groups)
    with torch.no_grad():
        delta.residual.gates.normal_()  # non-zero gates: routing shapes the forward
        for q in delta.residual.queries:
            q.normal_()
    outs: dict[int, torch.Tensor] = {}
    write = delta.residual.write

    def spy(state, site, out):
        outs[site] = out.detach().clone()
        return write(state, site, out)

    delta.residual.write = spy
    idx = torch.randint(0, 97, (2, 6))
    with torch.no_grad(), delta.residual.recording(sources=True) as rec:
        delta(idx)
    n_sites = 2 * n_layers
    g = groups or n_layers
    bounds = block_bounds(n_sites, g)
    group_sums = [sum(outs[s] for s in range(bounds[j], bounds[j + 1])).reshape(-1, 32) for j in range(g)]
    (final_sources, _, _), = rec.records[(0, n_sites)].captured
    assert final_sources.shape[0] == 1 + g
    assert torch.equal(final_sources[0], torch.zeros_like(final_sources[0]))  # the null source
    for j in range(g):
        torch.testing.assert_close(final_sources[1 + j], group_sums[j], atol=1e-6, rtol=1e-6)
    # a read inside a group sees the completed groups plus the group's partial sum
    for site in range(n_sites):
        (srcs, _, _), = rec.records[(0, site)].captured
        j = max(b for b in range(g) if bounds[b] <= site)
        assert srcs.shape[0] == 1 + j + (site > bounds[j])
        if site > bounds[j]:
            partial = sum(outs[s] for s in range(bounds[j], site)).reshape(-1, 32)
            torch.testing.assert_close(srcs[-1], partial, atol=1e-6, rtol=1e-6)


# ---- the CLI -------------------------------------------------------------------------------------
def _cli(argv):
    from archlab.analysis.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_convert_cli_round_trip(tmp_path, stdlib_data, real_tokens):
    from archlab.io.checkpoint import load_model, save_model

    run = make_config("tiny", overrides=["model.vocab_size=512", "model.n_layers=2", "model.d_model=64"])
    torch.manual_seed(3)
    base = build_model(run.model).eval()
    save_model(tmp_path / "base", base, run, tokenizer_path=stdlib_data / "tokenizer.json")
    out = tmp_path / "delta"
    assert _cli(["convert", "--to", "delta-mhar", "--ckpt", str(tmp_path / "base"), "--out", str(out),
                 "--heads", "8", "--groups", "2"]) == 0
    model, cfg, ckpt = load_model(out)
    assert cfg.model.residual.kind == "delta" and cfg.model.residual.heads == 8
    assert (ckpt / "tokenizer.json").is_file()
    with torch.no_grad():
        assert torch.equal(model.eval()(real_tokens[0]).logits, base(real_tokens[0]).logits)
    with pytest.raises(ArchlabError, match="standard-residual"):  # converting twice
        _cli(["convert", "--to", "delta-mhar", "--ckpt", str(out), "--out", str(tmp_path / "again")])
    with pytest.raises(ArchlabError, match="exists"):
        _cli(["convert", "--to", "delta-mhar", "--ckpt", str(tmp_path / "base"), "--out", str(out)])
    with pytest.raises(ArchlabError):
        _cli(["convert", "--to", "delta-mhar", "--ckpt", str(tmp_path / "missing"), "--out", str(out)])
