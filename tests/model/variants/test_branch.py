"""Decode-Branch Transformer: shared-KV attention, coupling, mixture readout, grouped decode."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from archlab.config import make_config
from archlab.infer.engine import Engine
from archlab.infer.sampling import SamplingParams
from archlab.model import build_model
from archlab.model.accounting import costs
from archlab.model.variants.branch.readout import mixture_log_probs as _mixture_log_probs
from archlab.model.variants.branch.readout import mixture_nll as _mixture_nll
from tests.helpers import tiny_model_cfg
from tests.infer.test_generate import assert_matches_full_forward

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "decode_branch"


def mixture_log_probs(pl, bl, cfg):
    return _mixture_log_probs(pl, bl, cfg.branch)


def mixture_nll(pl, bl, y, cfg):
    return _mixture_nll(pl, bl, y, cfg.branch)


def branch_model(seed=0, randomize_coupling=True, **branch):
    torch.manual_seed(seed)
    cfg = tiny_model_cfg()
    cfg.branch.enabled = True
    for k, v in branch.items():
        setattr(cfg.branch, k, v)
    model = build_model(cfg).eval()
    if randomize_coupling:  # zero-initialised in training; random here so that tests can fail
        for name, p in model.named_parameters():
            if ".couple_" in name:
                torch.nn.init.normal_(p, 0.0, 0.5)
    return model


def primary_only(model):
    """The same weights without the branch."""
    cfg = copy.deepcopy(model.cfg)
    cfg.branch.enabled = False
    base = build_model(cfg).eval()
    own = base.state_dict()
    base.load_state_dict({k: v for k, v in model.state_dict().items() if k in own})
    return base


def test_primary_logits_bitwise_identical_with_branch_on_or_off():
    model = branch_model()
    x = torch.randint(0, 97, (3, 17))
    with torch.no_grad():
        on = model(x).logits
        off = primary_only(model)(x).logits
        no_rows = model(x, followers=False).logits
    assert torch.equal(on, off) and torch.equal(on, no_rows)


def test_uncoupled_branch_with_shared_embedding_equals_primary():
    """Zero coupling, E2 = E1 and branch readout: the branch row is the primary row recomputed
    through shared-KV attention, which pins down that the branch queries the primary's K/V at <= t."""
    model = branch_model(randomize_coupling=False, readout="branch")
    with torch.no_grad():
        model.branch_emb.weight.copy_(model.tok_emb.weight)
        x = torch.randint(0, 97, (2, 21))
        out = model(x)
    torch.testing.assert_close(out.extra_logits[0], out.logits, atol=1e-6, rtol=0)
    # and a coupled branch with its own embedding differs
    other = branch_model(seed=1)
    with torch.no_grad():
        o = other(x)
    assert (o.extra_logits[0] - o.logits).abs().max() > 1e-3


@pytest.mark.parametrize("n_branches,readout", [(1, "mixture"), (2, "mixture"), (1, "branch")])
def test_grouped_decoding_reproduces_training_forward(n_branches, readout):
    model = branch_model(n_branches=n_branches, readout=readout)
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (13, 6, 10)]
    assert_matches_full_forward(model, seqs, prompt_lens=[4, 2, 8])


@pytest.mark.parametrize("mode", ["time", "heads"])
@pytest.mark.parametrize("kv_heads,sinks", [(4, False), (2, False), (1, False), (2, True)])
def test_grouped_decode_places_rows_on_time_or_heads_with_the_same_result(monkeypatch, mode, kv_heads, sinks):
    """The branch rows of a decode step as more queries or as more query heads (GQA over the same
    key/value heads): both reproduce the training forward, with and without grouped KV heads and
    attention sinks (whose per-head logit must follow its head into the folded layout)."""
    from archlab.model.core import layers

    monkeypatch.setattr(layers, "GROUPED_DECODE", mode)
    torch.manual_seed(3)
    cfg = tiny_model_cfg(n_kv_heads=kv_heads, attn_sinks=sinks)
    cfg.branch.enabled, cfg.branch.n_branches = True, 2
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".couple_" in name or name.endswith(".sink"):
                torch.nn.init.normal_(p, 0.0, 0.5)  # random, so that a misplaced row or sink fails
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (11, 6, 9)]
    assert_matches_full_forward(model, seqs, prompt_lens=[3, 2, 7])


def test_kv_cache_after_generation_equals_primary_only_cache():
    model = branch_model()
    base = primary_only(model)
    prompts = [[3, 4, 5, 6], [7, 8]]
    n = 9
    params = SamplingParams(max_new_tokens=n, temperature=1.0, seed=0)
    tokens = [r.tokens for r in Engine(model, slots=2, max_len=32).generate(prompts, params)]
    engines = Engine(model, slots=2, max_len=32), Engine(base, slots=2, max_len=32)
    for eng in engines:
        eng.prefill([0, 1], prompts, [params] * 2)
        for j in range(n - 1):
            eng.tokens.copy_(torch.tensor([t[j] for t in tokens]))
            eng.step()
    g, gb = engines
    for layer in range(model.cfg.n_layers):
        for kb, kp in zip(g.cache.layer(layer), gb.cache.layer(layer)):
            # One row per sequence (none for the branch) holding exactly what the primary-only
            # model writes, prefill padding included: the branch wrote nothing anywhere.
            assert kb.shape == kp.shape == (2, model.cfg.kv_heads, 32, model.cfg.dim_per_head)
            torch.testing.assert_close(kb, kp, atol=1e-6, rtol=0)
            assert torch.count_nonzero(kb[:, :, 16:]) == 0  # past the 16-token prefill bucket: never written


def _mixture_reference(pl: torch.Tensor, bl: torch.Tensor, y: torch.Tensor, lo=0.5, hi=1.0) -> torch.Tensor:
    p = torch.softmax(pl.double(), -1)
    q = torch.softmax(bl.double(), -1).mean(0)
    alpha = (p * p).sum(-1, keepdim=True).clamp(lo, hi)
    mix = alpha * p + (1 - alpha) * q
    return -torch.log(mix.gather(-1, y[..., None])).mean()


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_mixture_loss_and_gradient_match_float64(scale):
    cfg = tiny_model_cfg()
    cfg.branch.enabled = True
    torch.manual_seed(3)
    pl = (torch.randn(4, 6, 97) * scale).requires_grad_()
    bl = (torch.randn(2, 4, 6, 97) * scale).requires_grad_()
    y = torch.randint(0, 97, (4, 6))
    loss = -mixture_log_probs(pl, bl, cfg).gather(-1, y[..., None]).mean()
    loss.backward()
    pl64 = pl.detach().double().requires_grad_()
    bl64 = bl.detach().double().requires_grad_()
    ref = _mixture_reference(pl64, bl64, y)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    torch.testing.assert_close(pl.grad.double(), pl64.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(bl.grad.double(), bl64.grad, atol=1e-6, rtol=1e-4)
    # the training loss (gathers only) is the same function with the same gradient
    pl2, bl2 = pl.detach().clone().requires_grad_(), bl.detach().clone().requires_grad_()
    train_loss = mixture_nll(pl2, bl2, y, cfg)
    train_loss.backward()
    assert abs(train_loss.item() - ref.item()) < 1e-5
    torch.testing.assert_close(pl2.grad.double(), pl64.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(bl2.grad.double(), bl64.grad, atol=1e-6, rtol=1e-4)


def test_mixture_is_finite_when_alpha_saturates():
    cfg = tiny_model_cfg()
    cfg.branch.enabled = True
    pl = torch.full((1, 1, 97), -60.0)
    pl[..., 5] = 60.0  # p is one-hot: alpha = 1 and log(1 - alpha) would be -inf
    pl.requires_grad_()
    bl = torch.randn(1, 1, 1, 97, requires_grad=True)
    lp = mixture_log_probs(pl, bl, cfg)
    loss = -lp[..., 7].sum() + mixture_nll(pl, bl, torch.tensor([[7]]), cfg)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(pl.grad).all() and torch.isfinite(bl.grad).all()
    assert torch.allclose(lp.exp().sum(-1), torch.ones(1, 1))


def test_detach_alpha_changes_only_the_gradient():
    torch.manual_seed(4)
    pl = (torch.randn(2, 3, 97) * 6).requires_grad_()  # peaked: alpha inside (0.5, 1), not clamped
    bl = torch.randn(1, 2, 3, 97, requires_grad=True)
    y = torch.randint(0, 97, (2, 3))
    grads, values = [], []
    for detach in (False, True):
        cfg = tiny_model_cfg()
        cfg.branch.enabled, cfg.branch.detach_alpha = True, detach
        loss = -mixture_log_probs(pl, bl, cfg).gather(-1, y[..., None]).mean()
        values.append(loss.item())
        grads.append(torch.autograd.grad(loss, pl)[0])
    assert values[0] == values[1]
    assert not torch.allclose(grads[0], grads[1])


def test_training_reduces_mixture_loss_and_moves_coupling():
    torch.manual_seed(5)
    cfg = tiny_model_cfg()
    cfg.branch.enabled = True
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 97, (4, 24))
    first = None
    for _ in range(30):
        loss = model(x[:, :-1], x[:, 1:]).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.5
    assert model.layers[0].couple_q.a.abs().max() > 0


def test_ablation_ladder_configs():
    ladder = [make_config("tiny", [CONFIGS / f]).model.branch
              for f in ("1_minimal.yaml", "2_coupling.yaml", "3_mixture.yaml")]
    assert [(b.enabled, b.coupling, b.readout) for b in ladder] == [
        (True, False, "branch"), (True, True, "branch"), (True, True, "mixture")]
    minimal = build_model(make_config("tiny", [CONFIGS / "1_minimal.yaml"]).model)
    assert not any(".couple_" in n for n, _ in minimal.named_parameters())


def test_accounting_against_baseline():
    cfg = make_config("tiny", overrides=["model.branch.enabled=true"]).model
    base = make_config("tiny").model
    c, b = costs(cfg, 512), costs(base, 512)
    assert c["prefill_flops_per_token"] == b["prefill_flops_per_token"]
    assert 1.8 < c["decode_flops_per_token"] / b["decode_flops_per_token"] < 2.0
    assert 1.8 < c["train_flops_per_token"] / b["train_flops_per_token"] < 2.0
    d, L = cfg.d_model, cfg.n_layers
    extra = cfg.vocab_size * d + L * (cfg.n_heads * cfg.dim_per_head + cfg.hidden + d)
    assert c["params_total"] - b["params_total"] == extra == c["params_branch_extra"]
    assert c["params_active"] == b["params_active"]
    assert c["kv_bytes_per_token"] == b["kv_bytes_per_token"]
    # decode reads the same weights and KV; the coupling vectors and one more embedding row are
    # the only extra bytes
    assert c["decode_bytes_per_step"] - b["decode_bytes_per_step"] == 2 * (L * (cfg.n_heads * cfg.dim_per_head
                                                                                + cfg.hidden + d) + d)
    assert c["decode_bytes_per_step"] / b["decode_bytes_per_step"] < 1.005


# ---- the one-pass prefill (follower rows appended to the primary's time axis) ----------------------
def two_pass_prefill(model, idx, cache, lengths):
    """The former prefill, kept as the reference: the primary rows (``RecordPass``), then a second
    run over every layer for the follower rows of each prompt's last token (``FollowPass`` with
    ``lengths``), attending to the cache the primary rows wrote."""
    import dataclasses

    from archlab.model.core.context import Context
    from archlab.model.core.rows import last_of
    from archlab.model.variants.branch.module import FollowPass, RecordPass

    rows = model.rows
    b, t = idx.shape
    positions = torch.arange(t).expand(b, t)
    ctx = Context(rope=model.position.tables(t), cache=cache, positions=positions)
    record = RecordPass()
    hidden = model.run(model.tok_emb(idx), dataclasses.replace(ctx, rows=record))
    primary = model.logits(last_of(hidden, lengths))
    last = model.cache_context(cache, (lengths - 1)[:, None])
    last.rows = FollowPass(model.visit_blocks, record, lengths)
    branch = model.logits(model.run(rows.embed(model, last_of(idx, lengths)), last))
    return rows.log_probs(primary, branch.view(rows.n_branches, *primary.shape))[:, 0]


def _prefill_model(case: str):
    """A branch model of one kind, with every zero-initialised routing/coupling/sink parameter made
    random so that a misplaced row, tap, replay or sink changes the result."""
    from archlab.model.variants.attnres import ResidualConfig
    from archlab.model.variants.moe import MoEConfig

    over, branch = {}, {"n_branches": 2}
    if case == "n1":
        branch = {"n_branches": 1}
    elif case == "branch_readout":
        branch["readout"] = "branch"
    elif case == "uncoupled":
        branch["coupling"] = False
    elif case.startswith("moe"):
        routing = case.split("_")[1]
        over = dict(ffn="moe", moe=MoEConfig(n_experts=4, top_k=2, branch_top_k=1, shared_expert=True,
                                             branch_routing=routing))
    elif case == "attnres":
        over = dict(residual=ResidualConfig(kind="attnres", heads=1, blocks=0))
    elif case == "block_mhar":
        over = dict(residual=ResidualConfig(kind="attnres", heads=2, blocks=3), n_layers=3)
    elif case == "delta":
        over = dict(residual=ResidualConfig(kind="delta", heads=2))
    elif case == "sinks_gqa":
        over = dict(attn_sinks=True, n_kv_heads=1)
    elif case == "mha":
        over = dict(n_kv_heads=4)
    torch.manual_seed(11)
    cfg = tiny_model_cfg(**over)
    cfg.branch.enabled = True
    for k, v in branch.items():
        setattr(cfg.branch, k, v)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".couple_" in name or name.endswith(".sink") or name.startswith("residual."):
                p.add_(torch.randn_like(p) * 0.5)
    return model


PREFILL_CASES = ["n1", "n2", "branch_readout", "uncoupled", "moe_replay", "moe_independent", "attnres",
                 "block_mhar", "delta", "sinks_gqa", "mha"]


def _padded(seqs, t, pad):
    idx = torch.full((len(seqs), t), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        idx[i, : len(s)] = torch.tensor(s)
    return idx, torch.tensor([len(s) for s in seqs])


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_one_pass_prefill_equals_the_two_pass_prefill_and_the_full_forward(case):
    """Ragged prompts: the one-pass prefill's prediction equals the former two-pass prefill's and
    the full uncached forward's readout at each prompt's last token; it does not depend on the
    padding (an appended row that saw past ``lengths - 1`` would); and the cache holds exactly what
    the primary rows write (an appended row that wrote its keys/values anywhere would show)."""
    model = _prefill_model(case)
    base = primary_only(model)
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (9, 3, 12)]
    t = 16
    with torch.no_grad():
        caches = [model.new_cache(3, 32) for _ in range(3)]
        got = [model.prefill(_padded(seqs, t, pad)[0], cache, _padded(seqs, t, pad)[1])
               for pad, cache in zip((0, 5, 96), caches)]
        old = two_pass_prefill(model, *_padded(seqs, t, 0)[:1], model.new_cache(3, 32), _padded(seqs, t, 0)[1])
        base_cache = base.new_cache(3, 32)
        base.prefill(*_padded(seqs, t, 0)[:1], base_cache, _padded(seqs, t, 0)[1])
        for i, s in enumerate(seqs):
            ref = model.log_probs(model(torch.tensor([s])))[0, -1]
            torch.testing.assert_close(got[0][i], ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[0], old, atol=1e-5, rtol=0)
    for other in got[1:]:  # different padding after each prompt: the same prediction
        torch.testing.assert_close(other, got[0], atol=1e-6, rtol=0)
    for visit in range(caches[0].n_layers):
        for kb, kp in zip(caches[0].layer(visit), base_cache.layer(visit)):
            torch.testing.assert_close(kb, kp, atol=1e-6, rtol=0)
            assert torch.count_nonzero(kb[:, :, t:]) == 0  # nothing at the appended positions T..T+r-1


def test_appended_rows_neither_write_the_cache_nor_see_past_their_position():
    """Direct check of the two ways an appended row could leak: a prompt's cache slots are the
    primary-only model's, bitwise where the computation is the same per token, and moving what lies
    after a prompt (padding, other tokens) leaves the follower rows' prediction unchanged."""
    model = branch_model(n_branches=2, readout="branch")  # the branch rows alone make the prediction
    seqs = [[4, 5, 6, 7, 8], [9, 10]]
    with torch.no_grad():
        a = model.prefill(_padded(seqs, 8, 1)[0], model.new_cache(2, 16), torch.tensor([5, 2]))
        idx = _padded(seqs, 8, 1)[0]
        idx[1, 2:] = torch.arange(60, 66)  # visible keys/values if the branch rows saw past position 1
        cache = model.new_cache(2, 16)
        b = model.prefill(idx, cache, torch.tensor([5, 2]))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    base_cache = primary_only(model).new_cache(2, 16)
    with torch.no_grad():
        primary_only(model).prefill(idx, base_cache, torch.tensor([5, 2]))
    for layer in range(model.cfg.n_layers):
        for kb, kp in zip(cache.layer(layer), base_cache.layer(layer)):
            torch.testing.assert_close(kb, kp, atol=1e-6, rtol=0)
            assert torch.count_nonzero(kb[:, :, 8:]) == 0


def test_prefill_with_autograd_on_equals_inference():
    """With grad enabled the taps cannot write into the activation (a split's view): the
    concatenating fallback gives the same prediction."""
    model = branch_model(n_branches=2)
    idx, lengths = torch.randint(1, 97, (2, 8)), torch.tensor([8, 3])
    with torch.no_grad():
        ref = model.prefill(idx, model.new_cache(2, 16), lengths)
    got = model.prefill(idx, model.new_cache(2, 16), lengths)
    assert got.requires_grad
    torch.testing.assert_close(got.detach(), ref, atol=1e-6, rtol=0)


def test_prefill_runs_the_layers_once():
    """The follower rows run inside the primary's run: one ``run`` and one call of each sublayer
    per visit (the former prefill ran every layer twice)."""
    model = branch_model(n_branches=2)
    runs, calls = [], []
    real_run = model.run
    model.run = lambda x, ctx: runs.append(tuple(x.shape)) or real_run(x, ctx)
    for block in model.layers:
        real = block.attention
        block.attention = lambda h, ctx, real=real: calls.append(tuple(h.shape)) or real(h, ctx)
    with torch.no_grad():
        model.prefill(torch.randint(1, 97, (3, 8)), model.new_cache(3, 16), torch.tensor([8, 2, 5]))
    assert runs == [(3, 8 + 2, model.cfg.d_model)]  # the prompts plus one position per branch
    assert len(calls) == model.cfg.n_layers


def test_compiled_engine_generates_the_uncompiled_tokens():
    """``torch.compile`` traces the appended rows' pass (its in-place taps, gathers and the
    appended queries' mask) to the same greedy tokens as eager, on CPU."""
    model = branch_model(n_branches=2)
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    eager = [r.tokens for r in Engine(model, slots=2, max_len=32).generate(prompts, params)]
    compiled = [r.tokens for r in Engine(model, slots=2, max_len=32, compile=True).generate(prompts, params)]
    assert compiled == eager
