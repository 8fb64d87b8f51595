"""The zoo's options (Prism, TriPLU, gamma-init, LayerRoPE, variable width) composed in pairs, with each other and with the decode branch, MHAR (AttnRes
with 4 routing heads) and MoE: every pair builds, trains three optimizer steps with finite loss,
decodes from the KV cache exactly as the full forward predicts, and round-trips a checkpoint.
TriPLU and MoE are both kinds of the ffn slot, so that pair cannot be asked for (one model.ffn)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from archlab.config import make_config
from archlab.io.checkpoint import load_model, save_model
from archlab.model import build_model
from archlab.model.accounting import costs, per_layer
from tests.infer.test_generate import assert_matches_full_forward

ZOO = Path(__file__).resolve().parents[3] / "configs" / "zoo"
BASE = ["model.vocab_size=97", "model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2",
        "model.max_seq_len=64", "train.seq_len=32"]
OPTIONS = {
    "prism": ["model.heads=prism", "model.prism.head_dims=[32,16,8]"],  # 2x32, 4x16, 8x8 heads
    "triplu": ["model.ffn=triplu"],
    "gamma": ["model.init=gamma", "model.norm_eps=1e-12"],
    "layerrope": ["model.norm=layerrope", "model.layerrope.learnable=true"],
    "width": ["model.width=variable", "model.variable_width.head_dim=8", "model.variable_width.multiple_of=16"],
    "branch": ["model.branch.enabled=true"],
    "attnres": ["model.residual.kind=attnres", "model.residual.heads=4"],
    "moe": ["model.ffn=moe", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.shared_expert=true"],
}
ZOO_OPTIONS = ("prism", "triplu", "gamma", "layerrope", "width")
SAME_SLOT = {("triplu", "moe")}  # both fill the ffn slot
EXCLUDED = {("prism", "width")}  # refused at config time (tested in test_width.py)
PAIRS = [p for p in itertools.combinations(OPTIONS, 2)
         if (p[0] in ZOO_OPTIONS or p[1] in ZOO_OPTIONS) and p not in SAME_SLOT | EXCLUDED]



def run_config(*names: str, extra: tuple[str, ...] = ()):
    return make_config("tiny", overrides=[*BASE, *(o for n in names for o in OPTIONS[n]), *extra])


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_pair_trains_decodes_and_round_trips(pair, tmp_path):
    cfg = run_config(*pair)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    assert costs(cfg.model, 32)["params_total"] == sum(p.numel() for p in model.parameters())
    assert len(per_layer(cfg.model, 32)) == cfg.model.n_layers
    # three optimizer steps on random tokens
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    first = None
    for _ in range(3):
        tokens = torch.randint(0, 97, (4, 17), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        assert torch.isfinite(loss)
        first = first if first is not None else loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    # cached decode (prefill + step-by-step, ragged prompts) equals the full forward
    seqs = [torch.randint(1, 97, (n,), generator=gen).tolist() for n in (10, 6)]
    assert_matches_full_forward(model, seqs, prompt_lens=[4, 2])
    # checkpoint round trip: the same logits from the loaded model
    path = save_model(tmp_path / "ckpt", model, cfg)
    loaded, cfg2, _ = load_model(path)
    assert cfg2.model == cfg.model
    x = torch.randint(0, 97, (2, 12), generator=gen)
    with torch.no_grad():
        a, b = model(x), loaded.eval()(x)
    assert torch.equal(a.logits, b.logits)
    if a.extra_logits is not None:
        assert torch.equal(a.extra_logits, b.extra_logits)


def test_pairs_cover_every_zoo_option_with_every_other():
    assert len(PAIRS) == 23
    for z in ZOO_OPTIONS:
        partners = {q for p in PAIRS if z in p for q in p if q != z}
        excluded = {q for p in SAME_SLOT | EXCLUDED if z in p for q in p if q != z}
        assert partners == set(OPTIONS) - {z} - excluded


@pytest.mark.parametrize("path", sorted(ZOO.glob("*.yaml")), ids=lambda p: p.name)
def test_zoo_yamls_load_and_build(path):
    cfg = make_config("tiny", files=[path], overrides=BASE)
    build_model(cfg.model)


@pytest.mark.parametrize("option", ZOO_OPTIONS)
def test_delta_conversion_keeps_every_zoo_model_exactly(option):
    """``archlab convert --to delta-mhar`` on a model with each zoo option: the converted model
    computes the original function exactly (depth routing across widths included)."""
    from archlab.convert.delta import to_delta_mhar

    cfg = run_config(option).model
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    new_cfg, sd = to_delta_mhar(model.state_dict(), cfg, heads=4)
    converted = build_model(new_cfg).eval()
    converted.load_state_dict(sd)
    x = torch.randint(0, 97, (2, 14))
    with torch.no_grad():
        assert torch.equal(model(x).logits, converted(x).logits)
