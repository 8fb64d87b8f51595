"""Mixture-of-experts FFN: dispatch against a dense reference, router replay (in grouped rows and
in a follower-only pass), the load-balancing loss, parameter counts and a whole model that trains.

Everything runs on CPU in a few seconds. Exactness tests use float64 so that any routing or
combination error shows up far above rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torch import nn

from archlab.model import Transformer, registry
from archlab.model.config import ModelConfig
from archlab.model.core.context import Context, Pass
from archlab.model.core.spec import layer_specs
from archlab.model.variants.branch import BranchConfig
from archlab.model.variants.branch.module import Coupling, FollowPass, GroupedPass, RecordPass
from archlab.model.variants.moe import MoEConfig
from archlab.model.variants.moe.module import MoE, expert_hidden_size, load_balance_loss

D = 32


def make_moe(seed: int = 0, dtype: torch.dtype = torch.float64, **moe) -> MoE:
    """A standalone MoE layer with weights large enough that outputs are O(1)."""
    torch.manual_seed(seed)
    moe.setdefault("expert_hidden", 16)
    cfg = ModelConfig(d_model=D, n_heads=2, n_layers=2, ffn="moe", moe=MoEConfig(**moe))
    cfg.validate()
    layer = MoE(cfg, layer_specs(cfg)[0])
    with torch.no_grad():
        for p in (layer.router.weight, layer.w_gate_up, layer.w_down):
            p.normal_(0.0, 0.3)
        if layer.shared is not None:
            for p in layer.shared.parameters():
                p.normal_(0.0, 0.3)
    return layer.to(dtype)


def ctx(rows: Pass | None = None) -> Context:
    return Context(rope=None) if rows is None else Context(rope=None, rows=rows)


def blocks_with(c: Coupling | None) -> nn.ModuleList:
    """Stand-in layer 0 holding the hidden coupling ``b`` (the decode branch's ``couple_u``)."""
    block = nn.Module()
    block.couple_u = c
    return nn.ModuleList([block])


def grouped(x: torch.Tensor, c: Coupling | None = None) -> Context:
    """Primary rows of ``x`` and follower rows stacked after them (grouped decode's layout)."""
    return ctx(GroupedPass(blocks_with(c), x.shape[0]))


def two_passes(m: MoE, x: torch.Tensor, xb: torch.Tensor, c: Coupling | None = None,
               layer_ctx: Context | None = None) -> tuple[torch.Tensor, torch.Tensor, Context]:
    """The primary rows alone (recorded), then the follower rows alone (training's layout)."""
    record = RecordPass()
    primary_ctx = layer_ctx or ctx(record)
    primary_ctx.rows = record
    out_p = m(x, primary_ctx)
    out_b = m(xb, ctx(FollowPass(blocks_with(c), record)))
    return out_p, out_b, primary_ctx


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x @ [d, h] matrices (not nn.Linear layout)."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def dense_reference(m: MoE, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Run every expert on every row, weight by a dense gate matrix (zero where unselected)."""
    h = m.expert_hidden
    ys = torch.stack([swiglu(x, m.w_gate_up[e, :, :h], m.w_gate_up[e, :, h:], m.w_down[e])
                      for e in range(m.n_experts)], dim=-2)  # [..., E, d]
    dense_gates = torch.zeros(*x.shape[:-1], m.n_experts, dtype=x.dtype).scatter(-1, idx, gates.to(x.dtype))
    out = (dense_gates[..., None] * ys).sum(-2)
    if m.shared is not None:
        s = m.shared
        g, u = s.w_gate_up.weight.chunk(2, dim=0)
        out = out + swiglu(x, g.T, u.T, s.w_down.weight.T)
    return out


def reference_route(m: MoE, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k by router logits; gates = softmax over the selected logits."""
    logits = x @ m.router.weight.T
    top, idx = logits.topk(k, dim=-1)
    return idx, torch.softmax(top, dim=-1)


# ---- dispatch ----------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("shared", [False, True])
def test_dispatch_matches_dense_reference(top_k: int, shared: bool) -> None:
    m = make_moe(seed=top_k + 10 * shared, n_experts=4, top_k=top_k, shared_expert=shared)
    x = torch.randn(3, 7, D, dtype=torch.float64)
    out = m(x, ctx())
    idx, gates = reference_route(m, x, top_k)
    torch.testing.assert_close(out, dense_reference(m, x, idx, gates), rtol=0, atol=1e-12)
    assert out.abs().mean() > 1e-2  # the comparison is not between two near-zero tensors


def test_dropless_when_every_token_picks_one_expert() -> None:
    m = make_moe(n_experts=4, top_k=2)
    with torch.no_grad():
        m.router.weight[2, 0] = 100.0  # feature 0 is large and positive for every token below
    x = torch.randn(4, 9, D, dtype=torch.float64)
    x[..., 0] = 5.0 + x[..., 0].abs()
    primary, _ = m.route(x, ctx())
    assert (primary.idx[..., 0] == 2).all()  # all 36 tokens on expert 2 (no capacity limit)
    out = m(x, ctx())
    idx, gates = reference_route(m, x, 2)
    torch.testing.assert_close(out, dense_reference(m, x, idx, gates), rtol=0, atol=1e-12)


def test_gates_are_renormalised_top_k_softmax() -> None:
    m = make_moe(n_experts=6, top_k=3)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    r = m.route(x, ctx())[0]
    torch.testing.assert_close(r.gates.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    full = torch.softmax(x @ m.router.weight.T, dim=-1).gather(-1, r.idx)
    torch.testing.assert_close(r.gates, full / full.sum(-1, keepdim=True))


def test_routed_experts_get_gradients() -> None:
    m = make_moe(n_experts=4, top_k=2, shared_expert=True)
    x = torch.randn(2, 16, D, dtype=torch.float64)
    m.train()
    c = ctx()
    out = m(x, c)
    (out.square().sum() + c.aux_losses[0]).backward()
    used = torch.unique(m.route(x, ctx())[0].idx)
    assert m.router.weight.grad.abs().sum() > 0
    assert (m.w_gate_up.grad[used].flatten(1).abs().sum(-1) > 0).all()
    assert (m.w_down.grad[used].flatten(1).abs().sum(-1) > 0).all()


# ---- the decode branch -------------------------------------------------------------------------
def branch_rows(x: torch.Tensor, reps: int) -> torch.Tensor:
    """Branch rows that differ from the primary's: [reps * B, T, d], branch-major."""
    return torch.randn(reps * x.shape[0], *x.shape[1:], dtype=x.dtype)


def test_replay_uses_primary_experts_with_branch_gates() -> None:
    m = make_moe(n_experts=8, top_k=2, branch_routing="replay")
    x = torch.randn(3, 6, D, dtype=torch.float64)
    xb = branch_rows(x, 2)
    rp, rb = m.route(torch.cat([x, xb]), grouped(x))
    assert torch.equal(rb.idx, rp.idx.repeat(2, 1, 1))
    own = (xb @ m.router.weight.T).gather(-1, rb.idx)
    torch.testing.assert_close(rb.gates, torch.softmax(own, dim=-1))
    assert not torch.allclose(rb.gates, rp.gates.repeat(2, 1, 1), atol=1e-3)
    # and the forward pass computes exactly those experts with those gates, grouped or alone
    out_b = m(torch.cat([x, xb]), grouped(x))[x.shape[0]:]
    torch.testing.assert_close(out_b, dense_reference(m, xb, rb.idx, rb.gates), rtol=0, atol=1e-12)
    _, alone_b, _ = two_passes(m, x, xb)
    torch.testing.assert_close(alone_b, dense_reference(m, xb, rb.idx, rb.gates), rtol=0, atol=1e-12)


def test_replay_with_fewer_branch_experts_takes_the_branch_favourites() -> None:
    m = make_moe(n_experts=8, top_k=3, branch_top_k=1, branch_routing="replay")
    x = torch.randn(2, 10, D, dtype=torch.float64)
    xb = branch_rows(x, 1)
    rp, rb = m.route(torch.cat([x, xb]), grouped(x))
    assert rb.idx.shape == (2, 10, 1)
    own = (xb @ m.router.weight.T).gather(-1, rp.idx)  # branch logits at the primary's experts
    expected = rp.idx.gather(-1, own.argmax(-1, keepdim=True))
    assert torch.equal(rb.idx, expected)
    # the branch's favourite among all experts is often elsewhere: replay really restricts it
    assert not torch.equal(rb.idx, (xb @ m.router.weight.T).argmax(-1, keepdim=True))
    torch.testing.assert_close(rb.gates, torch.ones_like(rb.gates))


def test_independent_routing_routes_the_branch_itself() -> None:
    m = make_moe(n_experts=8, top_k=2, branch_top_k=3, branch_routing="independent")
    x = torch.randn(2, 10, D, dtype=torch.float64)
    xb = branch_rows(x, 1)
    rp, rb = m.route(torch.cat([x, xb]), grouped(x))
    idx, gates = reference_route(m, xb, 3)
    assert torch.equal(rb.idx, idx)
    torch.testing.assert_close(rb.gates, gates)
    assert not torch.equal(rb.idx[..., :2], rp.idx)
    _, out_b, _ = two_passes(m, x, xb)
    torch.testing.assert_close(out_b, dense_reference(m, xb, idx, gates), rtol=0, atol=1e-12)


def coupling(m: MoE, reps: int) -> Coupling | None:
    if m.shared is None:
        return None
    c = Coupling(reps, m.expert_hidden).to(m.w_down.dtype)
    with torch.no_grad():
        c.a.normal_()
    return c


@pytest.mark.parametrize("routing", ["replay", "independent"])
@pytest.mark.parametrize("shared", [False, True])
def test_primary_bitwise_identical_with_branch_rows(routing: str, shared: bool) -> None:
    m = make_moe(n_experts=4, top_k=2, shared_expert=shared, branch_routing=routing, dtype=torch.float32)
    m.train()
    x = torch.randn(2, 12, D)
    plain = ctx()
    alone = m(x, plain)
    both, _, recorded = two_passes(m, x, branch_rows(x, 2), coupling(m, 2))
    assert torch.equal(alone, both)
    (aux_alone,), (aux_both,) = plain.aux_losses, recorded.aux_losses  # the followers add none
    assert torch.equal(aux_alone, aux_both)


@pytest.mark.parametrize("routing", ["replay", "independent"])
def test_fused_matches_unfused(routing: str) -> None:
    m = make_moe(n_experts=4, top_k=2, branch_top_k=1, shared_expert=True, branch_routing=routing,
                 dtype=torch.float32)
    x = torch.randn(3, 5, D)
    xb = branch_rows(x, 2)
    c = coupling(m, 2)
    a_p, a_b, _ = two_passes(m, x, xb, c)
    b = m(torch.cat([x, xb]), grouped(x, c))
    torch.testing.assert_close(b, torch.cat([a_p, a_b]), rtol=1e-6, atol=1e-6)  # outputs are O(1)


def test_hidden_coupling_acts_on_the_shared_expert() -> None:
    """``u_b <- u_b + b * u_p`` on the shared expert's gated product, one ``b`` per branch."""
    m = make_moe(n_experts=4, top_k=2, shared_expert=True)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    xb = branch_rows(x, 2)
    c = coupling(m, 2)
    plain = two_passes(m, x, xb)[1]
    coupled = two_passes(m, x, xb, c)[1]
    s = m.shared
    g, u = s.w_gate_up.weight.chunk(2, dim=0)
    u_p = F.silu(x @ g.T) * (x @ u.T)  # [B, T, h]
    delta = (c.a[:, None, None, :] * u_p[None]) @ s.w_down.weight.T  # [R, B, T, d]
    torch.testing.assert_close(coupled - plain, delta.flatten(0, 1), rtol=0, atol=1e-12)
    assert delta.abs().mean() > 1e-2


@pytest.mark.parametrize("shared", [False, True])
def test_follower_pass_of_the_last_position_replays_the_record(shared: bool) -> None:
    """Prefill records the primary over the whole prompt; the follower rows of the last position
    alone (replaying experts and the coupled hidden from the record) must give what the joint
    forward gives the followers there."""
    m = make_moe(n_experts=8, top_k=3, branch_top_k=2, shared_expert=shared)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    xb = branch_rows(x, 2)
    c = coupling(m, 2)
    joint = two_passes(m, x, xb, c)[1]
    record = RecordPass()
    m(x, ctx(record))
    assert torch.equal(record.values[(0, "experts")], m.route(x, ctx())[0].idx)
    assert ((0, "u") in record.values) == shared
    out = m(xb[:, -1:], ctx(FollowPass(blocks_with(c), record, lengths=torch.full((2,), 6))))
    torch.testing.assert_close(out, joint[:, -1:], rtol=0, atol=1e-12)


# ---- load balancing ----------------------------------------------------------------------------
def test_aux_loss_hand_example() -> None:
    # two tokens, three experts, top-2: probabilities [1,2,3]/6 and [3,1,2]/6
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0], [3.0, 1.0, 2.0]], dtype=torch.float64) / 6)
    idx = logits.topk(2, dim=-1).indices  # {2, 1} and {0, 2}: slots per expert 1, 1, 2
    # f = [1/4, 1/4, 1/2], P = [1/3, 1/4, 5/12] -> 3 * (1/12 + 1/16 + 5/24) = 17/16
    assert math.isclose(load_balance_loss(logits, idx, 0.01).item(), 0.01 * 17 / 16, rel_tol=1e-12)


def test_aux_loss_is_coef_at_balance_and_grows_with_imbalance() -> None:
    n, e = 12, 4
    uniform = torch.zeros(n, e)
    balanced = torch.arange(n * 2).remainder(e).view(n, 2)
    assert math.isclose(load_balance_loss(uniform, balanced, 0.1).item(), 0.1, rel_tol=1e-6)
    # a router that prefers expert 0 and sends every token there
    skewed = torch.zeros(n, e)
    skewed[:, 0] = 2.0
    idx = skewed.topk(1, dim=-1).indices
    p0 = math.exp(2) / (math.exp(2) + 3)
    assert math.isclose(load_balance_loss(skewed, idx, 0.1).item(), 0.1 * e * p0, rel_tol=1e-6)
    assert load_balance_loss(skewed, idx, 0.1).item() > 0.1


def test_module_aux_loss_in_train_mode_only() -> None:
    m = make_moe(n_experts=4, top_k=2, aux_loss_coef=0.05)
    x = torch.randn(2, 8, D, dtype=torch.float64)
    m.train()
    c = grouped(x)
    m(torch.cat([x, branch_rows(x, 1)]), c)
    idx, _ = reference_route(m, x, 2)
    expected = load_balance_loss(x @ m.router.weight.T, idx, 0.05)  # primary rows only
    (got,) = c.aux_losses
    torch.testing.assert_close(got, expected)
    m.eval()
    c = ctx()
    m(x, c)
    assert c.aux_losses == []


# ---- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("top_k,branch_top_k", [(2, 0), (3, 1)])
def test_param_counts_match_module(shared: bool, top_k: int, branch_top_k: int) -> None:
    cfg = ModelConfig(d_model=64, n_heads=2, ffn="moe",
                      moe=MoEConfig(n_experts=6, top_k=top_k, branch_top_k=branch_top_k, shared_expert=shared))
    spec = layer_specs(cfg)[0]
    m = MoE(cfg, spec)
    counts = MoE.counts(cfg, spec)
    assert counts["total"] == sum(p.numel() for p in m.parameters()) == MoE.cost(cfg, spec).params
    per_expert = (m.w_gate_up.numel() + m.w_down.numel()) // m.n_experts
    rest = m.router.weight.numel() + (sum(p.numel() for p in m.shared.parameters()) if shared else 0)
    assert counts["active"] == rest + top_k * per_expert
    assert counts["active_branch"] == rest + (branch_top_k or top_k) * per_expert
    assert MoE.coupling_width(cfg, spec) == (m.expert_hidden if shared else 0)


def test_default_expert_size_matches_dense_active_params() -> None:
    # d=128: dense hidden 384
    for k, h in [(1, 384), (2, 192), (3, 128), (4, 128), (5, 128)]:
        cfg = ModelConfig(ffn="moe", moe=MoEConfig(n_experts=8, top_k=k))
        assert expert_hidden_size(cfg, layer_specs(cfg)[0]) == h
        assert k * h >= cfg.hidden
    assert registry.variants("ffn")["moe"].load() is MoE


# ---- a whole model -----------------------------------------------------------------------------
def tiny_model(seed: int = 0, **branch) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, ffn="moe",
                      moe=MoEConfig(n_experts=4, top_k=2, branch_top_k=1, shared_expert=True),
                      branch=BranchConfig(**branch))
    return Transformer(cfg)


@pytest.mark.parametrize("branch", [{}, {"enabled": True}, {"enabled": True, "n_branches": 2}])
def test_model_trains(branch: dict) -> None:
    model = tiny_model(**branch)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (4, 16), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        out = model(idx[:, :-1], idx[:, 1:])
        assert out.aux_loss is not None and out.aux_loss.item() > 0
        torch.testing.assert_close(out.loss, out.nll + out.aux_loss)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.nll.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_model_primary_logits_independent_of_branch() -> None:
    model = tiny_model(enabled=True, n_branches=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "couple" in name:
                p.normal_()
    idx = torch.randint(0, 64, (2, 12))
    assert torch.equal(model(idx).logits, model(idx, followers=False).logits)


def test_model_cached_decode_matches_full_forward() -> None:
    """Prefill (with the branch row of the last prompt token), then one grouped decode step: the
    branch's replayed experts and coupled shared hidden must reproduce the full forward."""
    model = tiny_model(enabled=True, n_branches=2).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "couple" in name:
                p.normal_(0.0, 0.5)
    b, s = 2, 7
    idx = torch.randint(0, 64, (b, s + 1))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(b, 16)
        first = model.prefill(idx[:, :s], cache, torch.full((b,), s))
        nxt = model.decode(idx[:, s:], cache, torch.full((b,), s))
        ref = model.log_probs(full)  # the mixture of the primary and both branches
    torch.testing.assert_close(first, ref[:, s - 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(nxt, ref[:, s], rtol=0, atol=1e-5)
    # the mixture really involves the branches: without them the prediction differs
    assert (ref - torch.log_softmax(full.logits, -1)).abs().max() > 1e-3
