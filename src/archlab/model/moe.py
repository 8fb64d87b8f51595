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
  training mode (``self.training``, with or without grad) and is ``None`` in eval mode, so
  evaluation losses are pure NLL. The branch rows do not enter it: they share the router, and under
  replay they do not choose experts at all.
- **Dispatch (dropless).** The (token, slot) assignments are sorted by expert so each expert sees
  one contiguous slice; expert weights are 3-D parameters (``w_gate_up [E, d, 2h]``,
  ``w_down [E, h, d]``). On CUDA with bf16 compute the slices run as two ``torch._grouped_mm``
  calls (no host sync); elsewhere a loop over experts (never over tokens) runs one matmul pair per
  non-empty expert. There is no capacity factor: no token is ever dropped. Outputs are un-sorted by
  a permutation gather and combined with a per-row weighted sum over the ``k`` slots (no atomic
  scatter-add), so the forward pass is deterministic.
- **Decode branch.** ``replay`` (default): the branch takes the primary's experts at the same
  layer and position (for ``k2 < k1`` the ``k2`` of them with the highest *branch* logits) and its
  own gates; the primary's choice at the last prompt position comes from the coupling stash in the
  branch-only step. ``independent``: the branch routes itself with top-``k2``. With ``fuse`` the
  router and the experts each run once over primary and branch rows together (one weight read);
  without it the primary is computed exactly as if no branch rows existed (bitwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archlab.config import ModelConfig, _round_up
from archlab.model.ffn import FFN, HiddenCoupling, SwiGLU, register_ffn
from archlab.model.layers import AttnContext, Groups, project


@dataclass
class Route:
    """The expert assignment of one row group."""

    idx: Tensor  # [rows, T, k] expert ids (int64)
    gates: Tensor  # [rows, T, k] combine weights, summing to 1 over k (fp32 or wider)
    logits: Tensor  # [rows, T, E] router logits (fp32 or wider)


def _wide(x: Tensor) -> Tensor:
    """At least fp32 (fp64 stays fp64, so float64 tests stay exact)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def load_balance_loss(logits: Tensor, idx: Tensor, coef: float) -> Tensor:
    """``coef * E * sum_e f_e * P_e`` (Switch Transformer / GShard auxiliary loss).

    ``logits`` [..., E] router logits, ``idx`` [..., k] the chosen experts. ``f_e`` is the share of
    token-slots sent to ``e`` (a count, no gradient); ``P_e`` the mean router probability, through
    which the gradient pushes probability away from over-used experts.
    """
    n_experts = logits.shape[-1]
    probs = torch.softmax(_wide(logits).reshape(-1, n_experts), dim=-1)
    counts = torch.bincount(idx.reshape(-1), minlength=n_experts).to(probs.dtype)
    f = counts / idx.numel()
    p = probs.mean(dim=0)
    return coef * n_experts * (f * p).sum()


@register_ffn("moe")
class MoE(FFN):
    """Top-k routed SwiGLU experts plus an optional shared expert; see the module docstring."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.d_model = cfg.d_model
        self.n_experts = m.n_experts
        self.top_k = m.top_k
        self.branch_top_k = m.branch_top_k or m.top_k
        self.branch_routing = m.branch_routing
        self.aux_loss_coef = m.aux_loss_coef
        self.expert_hidden = h = self.expert_hidden_size(cfg)
        self.router = nn.Linear(cfg.d_model, m.n_experts, bias=False)
        # Gate and up projections of every expert side by side: one matmul per expert slice.
        self.w_gate_up = nn.Parameter(torch.empty(m.n_experts, cfg.d_model, 2 * h))
        self.w_down = nn.Parameter(torch.empty(m.n_experts, h, cfg.d_model))
        self.shared: SwiGLU | None = SwiGLU(cfg, hidden=h) if m.shared_expert else None
        self.coupling_hidden = h if self.shared is not None else 0
        self.aux_loss: Tensor | None = None
        # The model re-initialises through init_weights; doing it here too keeps a standalone
        # module (tests, probes) on the same distribution.
        std = cfg.init_std
        self.init_weights(std, std / math.sqrt(2 * cfg.n_layers))

    # ---- sizes ----------------------------------------------------------------------------------
    @staticmethod
    def expert_hidden_size(cfg: ModelConfig) -> int:
        """``moe.expert_hidden``, or the dense hidden split over ``top_k`` (multiple of 64)."""
        m = cfg.moe
        if m.expert_hidden:
            return m.expert_hidden
        return _round_up(-(-cfg.hidden // m.top_k), 64)

    @staticmethod
    def param_counts(cfg: ModelConfig) -> dict[str, int]:
        """Per-layer parameters: ``total``; ``active`` (router + k1 experts + shared) for a primary
        row; ``active_branch`` (router + k2 experts + shared) for a branch row. Under replay the
        branch's experts are a subset of the primary's, so decode reads no extra expert weights,
        but each branch row still computes ``k2`` experts, which is what this counts."""
        m = cfg.moe
        d, h = cfg.d_model, MoE.expert_hidden_size(cfg)
        router = d * m.n_experts
        expert = 3 * d * h
        shared = expert if m.shared_expert else 0
        k2 = m.branch_top_k or m.top_k
        return {
            "total": router + m.n_experts * expert + shared,
            "active": router + m.top_k * expert + shared,
            "active_branch": router + k2 * expert + shared,
            "per_expert": expert,
            "coupling_hidden": h if m.shared_expert else 0,
        }

    def init_weights(self, std: float, out_std: float) -> None:
        """Normal(0, std) for the router and input projections, Normal(0, out_std) for outputs."""
        nn.init.normal_(self.router.weight, 0.0, std)
        nn.init.normal_(self.w_gate_up, 0.0, std)
        nn.init.normal_(self.w_down, 0.0, out_std)
        if self.shared is not None:
            nn.init.normal_(self.shared.w_gate_up.weight, 0.0, std)
            nn.init.normal_(self.shared.w_down.weight, 0.0, out_std)

    # ---- routing --------------------------------------------------------------------------------
    def _router_logits(self, hs: Groups, fuse: bool) -> Groups:
        """Router logits in at least fp32 with autocast off: a bf16 router flips near-tied
        choices, and the router is too small (``d x E``) for its precision to cost anything."""
        live = next(h for h in hs if h is not None)
        with torch.autocast(device_type=live.device.type, enabled=False):
            w = _wide(self.router.weight)

            def linear(x: Tensor) -> Tensor:
                return F.linear(_wide(x), w)

            return project(linear, hs, fuse)  # type: ignore[arg-type]  # any callable works

    def route(self, hs: Groups, ctx: AttnContext, layer: int, fuse: bool) -> list[Route | None]:
        """Expert ids and gates per row group (``None`` where the group is absent).

        Records the primary's choice in the coupling stash (the branch-only step after prefill
        replays it from there).
        """
        logits = self._router_logits(hs, fuse)
        routes: list[Route | None] = [None] * len(hs)
        if logits[0] is not None:
            top, idx = logits[0].topk(self.top_k, dim=-1)
            routes[0] = Route(idx, torch.softmax(top, dim=-1), logits[0])
            if ctx.stash is not None:
                ctx.stash.put(layer, "experts", idx)
        if len(hs) > 1 and logits[1] is not None:
            lb = logits[1]
            k2 = self.branch_top_k
            if self.branch_routing == "replay":
                if routes[0] is not None:
                    prim = routes[0].idx
                elif ctx.stash is not None:
                    prim = ctx.stash.get(layer, "experts")
                else:
                    raise ValueError("router replay needs the primary rows or a coupling stash")
                if k2 > prim.shape[-1]:
                    raise ValueError(f"router replay: branch_top_k={k2} exceeds top_k={prim.shape[-1]}")
                reps = lb.shape[0] // prim.shape[0]
                cand = prim.repeat(reps, 1, 1)  # branch-major rows: r*B + b <- primary row b
                cand_logits = lb.gather(-1, cand)
                if k2 < cand.shape[-1]:
                    cand_logits, pos = cand_logits.topk(k2, dim=-1)
                    cand = cand.gather(-1, pos)
                routes[1] = Route(cand, torch.softmax(cand_logits, dim=-1), lb)
            else:
                top, idx = lb.topk(k2, dim=-1)
                routes[1] = Route(idx, torch.softmax(top, dim=-1), lb)
        return routes

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
        counts = torch.bincount(expert, minlength=self.n_experts)
        xs = x.index_select(0, tok.index_select(0, order))
        ys = self._experts_sorted(xs, counts)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return ys.index_select(0, inv)

    @staticmethod
    def _assignments(route: Route, offset: int) -> tuple[Tensor, Tensor]:
        """Flat (token, expert) lists of a group, row-major over ``[rows*T, k]``."""
        idx = route.idx.reshape(-1, route.idx.shape[-1])
        tok = torch.arange(idx.shape[0], device=idx.device).repeat_interleave(idx.shape[1]) + offset
        return tok, idx.reshape(-1)

    @staticmethod
    def _combine(y: Tensor, gates: Tensor) -> Tensor:
        """``sum_k gate_k * y_k`` per row: y [N*k, d], gates [..., k] -> [N, d] in y's dtype."""
        k = gates.shape[-1]
        g = gates.reshape(-1, k, 1)
        return (y.view(-1, k, y.shape[-1]) * g).sum(dim=1).to(y.dtype)

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, hs: Groups, ctx: AttnContext, layer: int, fuse: bool,
                couple_hidden: HiddenCoupling | None = None) -> Groups:
        routes = self.route(hs, ctx, layer, fuse)
        self.aux_loss = None
        if self.training and routes[0] is not None and self.aux_loss_coef > 0:
            self.aux_loss = load_balance_loss(routes[0].logits, routes[0].idx, self.aux_loss_coef)

        live = [i for i, h in enumerate(hs) if h is not None]
        outs: Groups = [None] * len(hs)
        if fuse and len(live) > 1:
            # One pass over the experts for every row group: each expert's weights are read once.
            xs, toks, exps, sizes, offset = [], [], [], [], 0
            for i in live:
                x = hs[i].reshape(-1, self.d_model)
                tok, exp = self._assignments(routes[i], offset)
                xs.append(x), toks.append(tok), exps.append(exp), sizes.append(tok.numel())
                offset += x.shape[0]
            y = self.dispatch(torch.cat(xs), torch.cat(toks), torch.cat(exps))
            for i, yi in zip(live, y.split(sizes)):
                outs[i] = self._combine(yi, routes[i].gates).view(*hs[i].shape[:-1], self.d_model)
        else:
            for i in live:
                tok, exp = self._assignments(routes[i], 0)
                y = self.dispatch(hs[i].reshape(-1, self.d_model), tok, exp)
                outs[i] = self._combine(y, routes[i].gates).view(*hs[i].shape[:-1], self.d_model)

        if self.shared is not None:
            # SwiGLU stashes the primary's hidden ``u`` and applies the branch's hidden coupling.
            shared = self.shared(hs, ctx, layer, fuse, couple_hidden)
            outs = [o + s if o is not None else None for o, s in zip(outs, shared)]
        return outs
