"""Routed mixture-of-experts FFN (spec section 1, "Mixture-of-Experts variant").

    y = sum_{e in topk(x)} g_e(x) * SwiGLU_e(x)  [+ SharedSwiGLU(x)]

Design choices (the spec leaves them open; each is stated here once):

- **Router.** One bias-free linear map ``d -> n_experts``; logits, softmax and top-k run in at
  least fp32 so that bf16 autocast does not flip routing decisions on near-ties.
- **Gates.** Renormalised top-k softmax (Mixtral style): the softmax of the router logits over the
  *selected* experts only, so the ``k`` gates of a row sum to 1. This is the spec's rule for the
  branch ("softmax of its own router logits over those experts") and we use the same rule for the
  primary so both rows mix experts identically. Caveat: with ``k = 1`` the gate is always 1, so the
  router learns only through the load-balancing loss (Switch instead scales by the full-softmax
  probability); use ``top_k >= 2`` when router quality matters.
- **Expert size.** ``expert_hidden = 0`` means ``ceil(dense_hidden / top_k)`` rounded up to a
  multiple of 64, so the primary's active expert parameters match the dense SwiGLU's.
- **Shared expert.** One always-active SwiGLU of the *same* hidden size as a routed expert
  (DeepSeekMoE style: it costs as much as one more routed expert, not a second dense FFN). It is
  the only place the branch's hidden coupling ``u_b <- u_b + b * u_p`` applies, because the routed
  experts' hidden activations live in different experts for the two rows; without a shared expert
  ``coupling_hidden = 0`` and the branch has no ``b`` vector.
- **Load-balancing loss** (Switch/GShard): ``coef * E * sum_e f_e * P_e`` over the primary rows,
  ``f_e`` the fraction of the ``N * k1`` token-slots routed to ``e`` (so ``sum_e f_e = 1``, no
  gradient) and ``P_e`` the mean full-softmax router probability. Perfectly balanced routing with
  a uniform router gives exactly ``coef`` whatever ``k1``. It is computed on every forward in
  training mode (``self.training``, with or without grad) and added to ``ctx.aux_losses``; in
  eval mode there is none, so evaluation losses are pure NLL. The branch rows do not enter it: they share the router, and under
  replay they do not choose experts at all.
- **Dispatch (dropless).** The (token, slot) assignments are sorted by expert so each expert sees
  one contiguous slice; expert weights are 3-D parameters (``w_gate_up [E, d, 2h]``,
  ``w_down [E, h, d]``). On CUDA with bf16 compute the slices run as two ``torch._grouped_mm``
  calls (no host sync); elsewhere a loop over experts (never over tokens) runs one matmul pair per
  non-empty expert. There is no capacity factor: no token is ever dropped. Outputs are un-sorted by
  a permutation gather and combined with a per-row weighted sum over the ``k`` slots (no atomic
  scatter-add), so the forward pass is deterministic.
- **Follower rows (decode branch).** ``replay`` (default): a follower row takes its primary row's
  experts at the same visit and position (for ``k2 < k1`` the ``k2`` of them with the highest
  *follower* logits) and its own gates; the primary's choice reaches a follower-only pass through
  ``ctx.rows.share(ctx.visit, "experts", ...)``. ``independent``: followers route themselves with
  top-``k2``. When primary and follower rows share one activation (grouped decode; a prefill's
  follower rows appended on the time axis, ``ctx.rows.appended``, which replay the primary's
  choice at their position, ``ctx.rows.anchor``) the router and the experts each run once over
  all of them (one weight read); a primary-only pass is computed exactly as if no followers
  existed (bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archlab.model import registry
from archlab.model.core.context import Context
from archlab.model.core.cost import Cost
from archlab.model.core.ffn import SwiGLU
from archlab.model.core.init import NormalInit
from archlab.model.core.parallel import batch_sum
from archlab.typed import round_up

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec


@dataclass
class Route:
    """The expert assignment of one group of rows."""

    idx: Tensor  # [rows, T, k] expert ids (int64)
    gates: Tensor  # [rows, T, k] combine weights, summing to 1 over k (fp32 or wider)
    logits: Tensor  # [rows, T, E] router logits (fp32 or wider)


def _wide(x: Tensor) -> Tensor:
    """At least fp32 (fp64 stays fp64, so float64 tests stay exact)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def expert_counts(expert: Tensor, n_experts: int) -> Tensor:
    """Assignments per expert. ``bincount`` would do, but its output size depends on the data, which
    breaks a compiled graph (and, on CUDA, a captured decode step) at every MoE layer."""
    counts = torch.zeros(n_experts, dtype=torch.long, device=expert.device)
    return counts.scatter_add_(0, expert, torch.ones_like(expert))


def load_balance_loss(logits: Tensor, idx: Tensor, coef: float) -> Tensor:
    """``coef * E * sum_e f_e * P_e`` (Switch Transformer / GShard auxiliary loss).

    ``logits`` [..., E] router logits, ``idx`` [..., k] the chosen experts. ``f_e`` is the share of
    token-slots sent to ``e`` (a count, no gradient); ``P_e`` the mean router probability, through
    which the gradient pushes probability away from over-used experts.
    """
    n_experts = logits.shape[-1]
    probs = torch.softmax(_wide(logits).reshape(-1, n_experts), dim=-1)
    # Under data parallelism the shares are those of the whole global batch (summed over the
    # ranks), so N processes compute the loss one process would; counts.sum() is idx.numel()
    # (exactly, in float) on one process.
    counts = batch_sum(expert_counts(idx.reshape(-1), n_experts).to(probs.dtype))
    f = counts / counts.sum()
    p = probs.mean(dim=0)
    return coef * n_experts * (f * p).sum()


def expert_hidden_size(cfg: "ModelConfig", spec: "LayerSpec") -> int:
    """``moe.expert_hidden``, or the layer's dense hidden split over ``top_k`` (multiple of 64)."""
    m = cfg.moe
    if m.expert_hidden:
        return m.expert_hidden
    return round_up(-(-spec.hidden // m.top_k), 64)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts plus an optional shared expert; see the module docstring."""

    def __init__(self, cfg: "ModelConfig", spec: "LayerSpec"):
        super().__init__()
        m = cfg.moe
        self.layer = spec.layer
        self.d_model = spec.d
        self.n_experts = m.n_experts
        self.top_k = m.top_k
        self.branch_top_k = m.branch_top_k or m.top_k
        self.branch_routing = m.branch_routing
        self.aux_loss_coef = m.aux_loss_coef
        self.expert_hidden = h = expert_hidden_size(cfg, spec)
        self.router = nn.Linear(spec.d, m.n_experts, bias=False)
        # Gate and up projections of every expert side by side: one matmul per expert slice.
        self.w_gate_up = nn.Parameter(torch.empty(m.n_experts, spec.d, 2 * h))
        self.w_down = nn.Parameter(torch.empty(m.n_experts, h, spec.d))
        self.shared: SwiGLU | None = SwiGLU(cfg, spec, hidden=h) if m.shared_expert else None
        # The model initialises through init_parameters; doing it here too keeps a standalone
        # module (tests, probes) on the same distribution.
        self.init_parameters(NormalInit(cfg))

    # ---- sizes, init, cost -----------------------------------------------------------------------
    @classmethod
    def counts(cls, cfg: "ModelConfig", spec: "LayerSpec") -> dict[str, int]:
        """Per-layer parameters: ``total``; ``active`` (router + k1 experts + shared) for a primary
        row; ``active_branch`` (router + k2 experts + shared) for a follower row. Under replay the
        follower's experts are a subset of the primary's, so decode reads no extra expert weights,
        but each follower row still computes ``k2`` experts, which is what this counts."""
        m = cfg.moe
        d, h = spec.d, expert_hidden_size(cfg, spec)
        router = d * m.n_experts
        expert = 3 * d * h
        shared = expert if m.shared_expert else 0
        k2 = m.branch_top_k or m.top_k
        return {
            "total": router + m.n_experts * expert + shared,
            "active": router + m.top_k * expert + shared,
            "active_branch": router + k2 * expert + shared,
            "per_expert": expert,
        }

    @classmethod
    def cost(cls, cfg: "ModelConfig", spec: "LayerSpec") -> Cost:
        """MoE: a decode step of ``batch`` sequences reads the ``top_k`` experts of each (router
        replay adds none; independent routing may add up to ``branch_top_k`` more per follower,
        counted as the upper bound); the union is bounded by ``n_experts``."""
        c = cls.counts(cfg, spec)
        m = cfg.moe
        followers = registry.followers(cfg)

        def decode_params(batch: int) -> int:
            used = min(m.n_experts, batch * m.top_k)
            if followers and m.branch_routing == "independent":
                used = min(m.n_experts, used + batch * followers * (m.branch_top_k or m.top_k))
            return c["total"] - (m.n_experts - used) * c["per_expert"]

        return Cost(params=c["total"], active=c["active"], flops=2 * c["active"],
                    flops_follower=2 * c["active_branch"], decode_params=decode_params)

    @classmethod
    def coupling_width(cls, cfg: "ModelConfig", spec: "LayerSpec") -> int:
        """The shared expert's hidden is the only ``u`` both rows compute in the same expert: the
        routed experts' hidden activations live in different experts for the two rows."""
        return expert_hidden_size(cfg, spec) if cfg.moe.shared_expert else 0

    def init_parameters(self, init: "Init") -> None:
        init.linear(self.router.weight, role="in")
        init.weight(self.w_gate_up, self.d_model, "in")
        init.weight(self.w_down, self.expert_hidden, "out")
        if self.shared is not None:
            self.shared.init_parameters(init)

    # ---- routing --------------------------------------------------------------------------------
    def _router_logits(self, x: Tensor) -> Tensor:
        """Router logits in at least fp32 with autocast off: a bf16 router flips near-tied
        choices, and the router is too small (``d x E``) for its precision to cost anything."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(_wide(x), _wide(self.router.weight))

    def route(self, x: Tensor, ctx: Context) -> tuple[Route | None, Route | None]:
        """Expert ids and gates of the primary rows and of the follower rows (None when absent).

        The primary's choice goes through ``ctx.rows.share`` so that a later follower-only pass
        can replay it.
        """
        lead = ctx.rows.lead(x.shape[0])
        appended = ctx.rows.appended  # follower positions at the end of the time axis (a prefill)
        logits = self._router_logits(x)
        primary = follower = None
        prim_idx = None
        if appended:
            lp, lb = logits[:, :-appended], logits[:, -appended:]
        else:
            lp = logits[:lead] if lead < x.shape[0] else logits
            lb = logits[lead:] if lead < x.shape[0] else None
        if lead:
            top, idx = lp.topk(self.top_k, dim=-1)
            primary = Route(idx, torch.softmax(top, dim=-1), lp)
            prim_idx = ctx.rows.share(ctx.visit, "experts", idx)
        if lb is not None:
            k2 = self.branch_top_k
            if self.branch_routing == "replay":
                prim = prim_idx if prim_idx is not None else ctx.rows.share(ctx.visit, "experts", None)
                if prim is None:
                    raise ValueError("router replay needs the primary rows' expert choice")
                if k2 > prim.shape[-1]:
                    raise ValueError(f"router replay: branch_top_k={k2} exceeds top_k={prim.shape[-1]}")
                if appended:  # each appended row replays its sequence's choice at its position
                    cand = ctx.rows.anchor(prim)
                else:
                    prim = prim[:, prim.shape[1] - lb.shape[1]:]  # followers of the last positions only
                    reps = lb.shape[0] // prim.shape[0]
                    cand = prim.repeat(reps, 1, 1)  # branch-major rows: r*B + b <- primary row b
                cand_logits = lb.gather(-1, cand)
                if k2 < cand.shape[-1]:
                    cand_logits, pos = cand_logits.topk(k2, dim=-1)
                    cand = cand.gather(-1, pos)
                follower = Route(cand, torch.softmax(cand_logits, dim=-1), lb)
            else:
                top, idx = lb.topk(k2, dim=-1)
                follower = Route(idx, torch.softmax(top, dim=-1), lb)
        return primary, follower

    # ---- expert computation ---------------------------------------------------------------------
    def _grouped_ok(self, x: Tensor) -> bool:
        """Whether ``torch._grouped_mm`` can run the expert slices (CUDA, bf16, 16-byte rows)."""
        if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
            return False
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        return dtype == torch.bfloat16 and self.d_model % 8 == 0 and self.expert_hidden % 8 == 0

    def _experts_sorted(self, xs: Tensor, counts: Tensor) -> Tensor:
        """SwiGLU of each expert over its contiguous slice of expert-sorted rows ``xs`` [M, d]."""
        if self._grouped_ok(xs):
            offs = counts.cumsum(0).to(torch.int32)
            xb = xs.to(torch.bfloat16)
            gu = torch._grouped_mm(xb, self.w_gate_up.to(torch.bfloat16), offs=offs)
            g, u = gu.chunk(2, dim=-1)
            act = (F.silu(g) * u).contiguous()
            return torch._grouped_mm(act, self.w_down.to(torch.bfloat16), offs=offs)
        outs = []
        for e, xe in enumerate(xs.split(counts.tolist())):
            if xe.shape[0] == 0:
                continue
            g, u = (xe @ self.w_gate_up[e]).chunk(2, dim=-1)
            outs.append((F.silu(g) * u) @ self.w_down[e])
        if not outs:
            return xs.new_zeros(0, self.d_model)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def dispatch(self, x: Tensor, tok: Tensor, expert: Tensor) -> Tensor:
        """Expert outputs (un-gated) of assignments ``(tok[a], expert[a])``, in assignment order.

        ``x`` [N, d] rows, ``tok``/``expert`` [M] int64. Dropless: every assignment is computed.
        """
        order = torch.argsort(expert, stable=True)
        counts = expert_counts(expert, self.n_experts)
        xs = x.index_select(0, tok.index_select(0, order))
        ys = self._experts_sorted(xs, counts)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return ys.index_select(0, inv)

    @staticmethod
    def _assignments(route: Route, offset: int, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Flat (token, expert) lists of a group, row-major over ``[rows*T, k]``: its tokens are
        ``offset ..`` in that order, or the flat token ids ``tokens`` [rows, T]."""
        idx = route.idx.reshape(-1, route.idx.shape[-1])
        if tokens is None:
            tok = torch.arange(idx.shape[0], device=idx.device) + offset
        else:
            tok = tokens.reshape(-1)
        return tok.repeat_interleave(idx.shape[1]), idx.reshape(-1)

    @staticmethod
    def _combine(y: Tensor, gates: Tensor) -> Tensor:
        """``sum_k gate_k * y_k`` per row: y [N*k, d], gates [..., k] -> [N, d] in y's dtype."""
        k = gates.shape[-1]
        g = gates.reshape(-1, k, 1)
        return (y.view(-1, k, y.shape[-1]) * g).sum(dim=1).to(y.dtype)

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        primary, follower = self.route(x, ctx)
        if self.training and primary is not None and self.aux_loss_coef > 0:
            ctx.add_aux_loss(load_balance_loss(primary.logits, primary.idx, self.aux_loss_coef))
        flat = x.reshape(-1, self.d_model)
        routes = [r for r in (primary, follower) if r is not None]
        appended = ctx.rows.appended
        # Appended follower positions sit at the end of each row's time axis, not after the
        # primary rows: each group names its tokens' flat ids.
        ids = torch.arange(flat.shape[0], device=x.device).view(x.shape[:2]) if appended else None
        groups = [ids[:, :-appended], ids[:, -appended:]] if appended else [None] * len(routes)
        # One pass over the experts for every row: each expert's weights are read once.
        toks, exps, offset = [], [], 0
        for r, tokens in zip(routes, groups):
            tok, exp = self._assignments(r, offset, tokens)
            toks.append(tok), exps.append(exp)
            offset += r.idx.shape[0] * r.idx.shape[1]
        tok, exp = (toks[0], exps[0]) if len(routes) == 1 else (torch.cat(toks), torch.cat(exps))
        y = self.dispatch(flat, tok, exp)
        outs = [self._combine(yi, r.gates) for yi, r in zip(y.split([t.numel() for t in toks]), routes)]
        if appended:
            out = torch.cat([o.view(*r.idx.shape[:2], self.d_model) for o, r in zip(outs, routes)], dim=1)
        else:
            out = (outs[0] if len(outs) == 1 else torch.cat(outs)).view(*x.shape[:-1], self.d_model)
        if self.shared is not None:
            # SwiGLU taps the hidden ``u``, where the decode branch couples its rows.
            out = out + self.shared(x, ctx)
        return out
