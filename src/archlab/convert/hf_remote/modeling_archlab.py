"""archlab's decoder in plain PyTorch, for transformers' remote code.

Copied verbatim into an export folder by ``archlab export-hf`` (with ``configuration_archlab.py``)
and loaded from there by ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``.
It imports torch and transformers only, never archlab: whoever receives the folder runs it
without archlab installed. So it carries its own implementation of what it supports, written
from archlab's definitions (``docs/architectures.md``) and tested against archlab's logits.

The network is built from ``config.layout``, which the exporter fills with plain numbers:

* ``layers``: each layer's width ``d``, ``n_heads``, ``n_kv_heads``, ``head_dim``, FFN
  ``hidden`` and whether its attention has a sink logit per head (covers uniform and per-layer
  heads, Prism heads and variable width alike: the exporter resolved their rules);
* ``visits``: the layers in the order a forward runs them (a layer may repeat: a loop);
* ``base_width``: the embedding's width; between layers of different widths the residual
  stream is resized without parameters (shrink: keep the first coordinates; grow: refill from
  the latest earlier state that was wide enough, else zeros);
* ``norm``: ``rmsnorm`` (a gain per site) or ``layerrope`` (one shared gain rotated per layer);
* ``ffn``: ``swiglu``, ``triplu`` (a product of projections, optionally normalised) or ``moe``
  (top-k routed SwiGLU experts with renormalised gates, an optional shared expert);
* ``residual``: ``standard`` (``x + f(x)``), ``attnres`` (each sublayer reads a softmax over depth
  of the embedding and earlier outputs or block sums, per routing head: AttnRes, Block AttnRes,
  MHAR) or ``delta`` (the standard stream plus a gated route over a null source and group sums);
* ``channel``: a loop's discrete channel before some visits, or None;
* ``branch``: the decode branch (follower rows with their own embedding that query the primary
  rows' keys/values and add coupled multiples of the primary's activations), or None.

Parameter names are archlab's own (under ``model.``), so the exported weights are archlab's
tensors unchanged and ``archlab import-hf`` reads them back bit for bit. The output ``logits``
are the head's logits, except with the decode branch: there they are the log-probabilities of
its readout (the mixture of primary and branch predictions), which is what archlab predicts;
softmax and argmax of either are the prediction's. There is no KV cache: every step of
``generate`` runs the whole sequence again (exact, slower on long outputs).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_archlab import ArchlabConfig


def rms_normalise(x, eps):
    """``x / rms(x)`` in at least fp32 (16-bit sums of squares lose too much at large widths)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, width, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return (rms_normalise(x, self.eps) * self.weight.float()).type_as(x)


# ---- LayerRoPE: one gain vector shared by every site, rotated and scaled with depth ---------------
LAYERROPE_SITES = ("attn_in", "attn_out", "mlp_in", "mlp_out", "final")
LAYERROPE_SCALARS = ("a", "b", "a_rot", "b_rot")


class LayerRopeGains(nn.Module):
    """Holds ``g`` (and the four scalars per site set when they were trained); ``gain`` is the
    rotated gain of a layer: pairs ``(g_2j, g_2j+1)`` as complex numbers times
    ``exp(r + i theta_j)``, ``r = a + b u``, ``theta_j = exp(a_rot + b_rot u) base^(-2j/d)``,
    ``u = log(layer + 1)``."""

    def __init__(self, opts, width, eps):
        super().__init__()
        self.opts, self.d, self.eps = opts, width, eps
        self.g = nn.Parameter(torch.ones(width, dtype=torch.float32))
        self.learnable = opts["learnable"]
        self.n_sets = len(LAYERROPE_SITES) if opts["per_site"] else 1
        if self.learnable:
            for name in LAYERROPE_SCALARS:
                setattr(self, name, nn.Parameter(torch.full((self.n_sets,), float(opts[name]))))

    def scalars(self, site):
        if not self.learnable:
            return tuple(self.opts[n] for n in LAYERROPE_SCALARS)
        k = LAYERROPE_SITES.index(site) if self.n_sets > 1 else 0
        return tuple(getattr(self, n)[k] for n in LAYERROPE_SCALARS)

    def gain(self, layer, site, width):
        g = self.g if self.g.dtype in (torch.float32, torch.float64) else self.g.float()
        a, b, a_rot, b_rot = self.scalars(site)
        u = math.log(layer + 1)
        half = self.d // 2
        # the frequencies in fp64 first, as archlab computes them, then in g's dtype
        freqs = self.opts["base"] ** (-2 * torch.arange(half, device=g.device, dtype=torch.float64) / self.d)
        scale = torch.exp(torch.as_tensor(a + b * u, dtype=g.dtype, device=g.device))
        speed = torch.exp(torch.as_tensor(a_rot + b_rot * u, dtype=g.dtype, device=g.device))
        theta = speed * freqs.to(g.dtype)
        cos, sin = torch.cos(theta), torch.sin(theta)
        gr, gi = g[0::2], g[1::2]
        out = torch.stack((gr * cos - gi * sin, gr * sin + gi * cos), dim=-1).flatten() * scale
        return out[:width]


class RotatedGain(nn.Module):
    """One LayerRoPE site: (an RMSNorm without a gain of its own, when ``normalise``) times the
    shared rotated gain. The owner sits in a tuple so that ``g`` is registered once."""

    def __init__(self, owner, layer, site, width, normalise):
        super().__init__()
        self._owner = (owner,)
        self.layer, self.site, self.width, self.normalise = layer, site, width, normalise

    def forward(self, x):
        owner = self._owner[0]
        gain = owner.gain(self.layer, self.site, self.width)
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        if self.normalise:
            xf = rms_normalise(xf, owner.eps)
        return (xf * gain.to(xf.dtype)).type_as(x)


class RMSNormSites(nn.Module):
    """The ``rmsnorm`` norm layout: an RMSNorm with its own gain before each sublayer and before
    the head; nothing at the sublayer outputs."""

    def __init__(self, layout, eps):
        super().__init__()
        self.eps = eps

    def site(self, layer, name, width):
        return None if name in ("attn_out", "mlp_out") else RMSNorm(width, self.eps)


class LayerRopeSites(LayerRopeGains):
    """The ``layerrope`` norm layout: every per-layer site uses the shared rotated gain; the
    final site is a plain RMSNorm (``final: rmsnorm``) or the gain at depth ``n_layers``."""

    def site(self, layer, name, width):
        if name in ("attn_out", "mlp_out"):
            return RotatedGain(self, layer, name, width, False) if self.opts["out_sites"] else None
        if name == "final" and self.opts["final"] == "rmsnorm":
            return RMSNorm(width, self.eps)
        return RotatedGain(self, layer, name, width, True)


def norm_sites(layout, eps):
    kind = layout["norm"]["kind"]
    if kind == "rmsnorm":
        return RMSNormSites(layout, eps)
    if kind == "layerrope":
        return LayerRopeSites(layout["norm"], layout["base_width"], eps)
    raise ValueError(f"norm kind {kind!r} is not implemented by this modeling file")


# ---- what a pass over the layers shares with the decode branch's follower rows --------------------------
class PlainTaps:
    """Primary rows with no followers: every tap returns its input."""

    follower = False

    def tap(self, visit, name, x):
        return x

    def kv(self, visit, k, v):
        return k, v


class RecordingTaps(PlainTaps):
    """Primary rows whose followers run next: keep the activations they couple to (``q``, the
    FFN hidden ``u``, the FFN output ``m``) and the keys/values they attend to, per visit."""

    def __init__(self):
        self.values = {}

    def tap(self, visit, name, x):
        self.values[(visit, name)] = x
        return x

    def kv(self, visit, k, v):
        self.values[(visit, "kv")] = (k, v)
        return k, v


class FollowerTaps(PlainTaps):
    """Follower rows, branch-major (row ``r * B + b`` is branch ``r`` of sequence ``b``): a tap
    adds ``a_r * primary`` (the block's coupling vector at that site, when it has one); keys and
    values are the primary's."""

    follower = True

    def __init__(self, blocks, record):
        self.blocks, self.values = blocks, record.values

    def tap(self, visit, name, x):
        couple = getattr(self.blocks[visit], "couple_" + name, None)
        if couple is None:
            return x
        src = self.values[(visit, name)]
        reps = couple.a.shape[0]
        out = x.view(reps, src.shape[0], *x.shape[1:]) + couple.a[:, None, None, :] * src[None]
        return out.reshape(x.shape)

    def kv(self, visit, k, v):
        k, v = self.values[(visit, "kv")]
        return k, v


class Coupling(nn.Module):
    def __init__(self, n_branches, width):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(n_branches, width))


# ---- attention --------------------------------------------------------------------------------------
def rope_tables(head_dim, positions, theta):
    """cos/sin [*positions.shape, hd/2] in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """RoPE on halves (the Llama convention) of ``x`` [B, H, T, hd], in fp32; cos/sin [T, hd/2]
    (shared positions) or [B', T, hd/2] per row (follower rows repeat their sequences' rows)."""
    if cos.dim() == 3:
        reps = x.shape[0] // cos.shape[0]
        cos, sin = cos.repeat(reps, 1, 1)[:, None], sin.repeat(reps, 1, 1)[:, None]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention with one fused [q; k; v] projection and, with ``sinks``,
    one learned logit per head for a key whose value is zero (the softmax may attend to nothing).
    Follower rows project queries only and attend to their sequence's primary keys/values."""

    def __init__(self, spec):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec["n_heads"], spec["n_kv_heads"], spec["head_dim"]
        self.q_dim, self.kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wqkv = nn.Linear(spec["d"], self.q_dim + 2 * self.kv_dim, bias=False)
        self.wo = nn.Linear(self.q_dim, spec["d"], bias=False)
        self.sink = nn.Parameter(torch.zeros(self.n_heads)) if spec["sinks"] else None

    def forward(self, x, rope, taps, visit, allowed=None):
        """``allowed`` [B', 1, T, T]: which keys each query sees (left-padded batches), or None for
        plain causal attention."""
        b, t, _ = x.shape
        cos, sin = rope[self.head_dim]
        if taps.follower:
            q, k, v = F.linear(x, self.wqkv.weight[: self.q_dim]), None, None
        else:
            q, k, v = self.wqkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
            k = rotate(k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = taps.tap(visit, "q", q)
        q = rotate(q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k, v = taps.kv(visit, k, v)
        if k.shape[0] != b:  # follower rows: every branch reads its sequence's keys/values
            k, v = k.repeat(b // k.shape[0], 1, 1, 1), v.repeat(b // v.shape[0], 1, 1, 1)
        group = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if allowed is not None and allowed.shape[0] != b:
            allowed = allowed.repeat(b // allowed.shape[0], 1, 1, 1)
        if self.sink is None:
            if allowed is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        else:
            scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5
            if allowed is None:
                allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
            sink = self.sink.to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, t, 1)
            weights = torch.softmax(torch.cat([sink, scores], dim=-1), dim=-1)[..., 1:]
            out = weights @ v
        return self.wo(out.transpose(1, 2).reshape(b, t, self.q_dim))


# ---- feed-forward -----------------------------------------------------------------------------------
class SwiGLU(nn.Module):
    def __init__(self, spec, opts, eps):
        super().__init__()
        self.hidden = spec["hidden"]
        self.w_gate_up = nn.Linear(spec["d"], 2 * self.hidden, bias=False)
        self.w_down = nn.Linear(self.hidden, spec["d"], bias=False)

    def forward(self, x, taps, visit):
        g, u = self.w_gate_up(x).split(self.hidden, dim=-1)
        return self.w_down(taps.tap(visit, "u", F.silu(g) * u))


class TriPLU(nn.Module):
    """``W_o N(prod_k W_k x)``: ``degree`` projections multiplied, an optional RMSNorm over the
    hidden width (with a gain), one output projection."""

    def __init__(self, spec, opts, eps):
        super().__init__()
        self.hidden, self.degree, self.eps = spec["hidden"], opts["degree"], eps
        self.w_in = nn.Linear(spec["d"], self.degree * self.hidden, bias=False)
        self.w_out = nn.Linear(self.hidden, spec["d"], bias=False)
        self.norm_weight = nn.Parameter(torch.ones(self.hidden)) if opts["norm"] else None

    def forward(self, x, taps, visit):
        parts = self.w_in(x).split(self.hidden, dim=-1)
        p = parts[0]
        for q in parts[1:]:
            p = p * q
        if self.norm_weight is not None:
            p = (rms_normalise(p, self.eps) * self.norm_weight.float()).type_as(p)
        return self.w_out(taps.tap(visit, "u", p))


class MoE(nn.Module):
    """``sum over the top-k experts e of g_e SwiGLU_e(x)`` (+ a shared SwiGLU): router logits in
    fp32, gates the softmax over the chosen experts' logits; every token reaches its experts."""

    def __init__(self, spec, opts, eps):
        super().__init__()
        d, h, n = spec["d"], spec["hidden"], opts["n_experts"]
        self.top_k, self.hidden = opts["top_k"], h
        self.router = nn.Linear(d, n, bias=False)
        self.w_gate_up = nn.Parameter(torch.zeros(n, d, 2 * h))
        self.w_down = nn.Parameter(torch.zeros(n, h, d))
        self.shared = SwiGLU({"d": d, "hidden": h}, opts, eps) if opts["shared_expert"] else None

    def forward(self, x, taps, visit):
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat.float(), self.router.weight.float())
        top, chosen = logits.topk(self.top_k, dim=-1)
        gates = torch.softmax(top, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.w_gate_up.shape[0]):
            hit = chosen == e
            rows = hit.any(dim=-1).nonzero().flatten()
            if rows.numel() == 0:
                continue
            g, u = (flat[rows] @ self.w_gate_up[e]).chunk(2, dim=-1)
            y = (F.silu(g) * u) @ self.w_down[e]
            out.index_add_(0, rows, y * (gates * hit).sum(dim=-1)[rows, None].to(y.dtype))
        out = out.view(x.shape)
        return out if self.shared is None else out + self.shared(x, taps, visit)


FFNS = {"swiglu": SwiGLU, "triplu": TriPLU, "moe": MoE}


class Block(nn.Module):
    """One layer's sublayers with their norm sites (and the decode branch's coupling vectors)."""

    def __init__(self, layer, spec, norms, ffn, branch, eps):
        super().__init__()
        d = spec["d"]
        self.attn_norm = norms.site(layer, "attn_in", d)
        self.attn = Attention(spec)
        self.attn_out_norm = norms.site(layer, "attn_out", d)
        self.mlp_norm = norms.site(layer, "mlp_in", d)
        self.mlp = FFNS[ffn["kind"]](spec, ffn, eps)
        self.mlp_out_norm = norms.site(layer, "mlp_out", d)
        if branch is not None and branch["coupling"]:
            r = branch["n_branches"]
            self.couple_q = Coupling(r, self.attn.q_dim)
            self.couple_u = Coupling(r, spec["coupling_width"]) if spec["coupling_width"] else None
            self.couple_m = Coupling(r, d)

    def attention(self, h, rope, taps, visit, allowed):
        out = self.attn(self.attn_norm(h), rope, taps, visit, allowed)
        return out if self.attn_out_norm is None else self.attn_out_norm(out)

    def feed_forward(self, h, taps, visit):
        out = self.mlp(self.mlp_norm(h), taps, visit)
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(out)
        return taps.tap(visit, "m", out)


# ---- the residual stream ----------------------------------------------------------------------------
def resize_stream(x, width, seen):
    """Shrinking keeps the first ``width`` coordinates; growing refills the new ones from the
    latest earlier state that was wide enough, else zeros (no parameters)."""
    seen.append(x)
    w = x.shape[-1]
    if width <= w:
        return x[..., :width]
    src = next((s for s in reversed(seen) if s.shape[-1] >= width), None)
    fill = src[..., w:width] if src is not None else x.new_zeros(*x.shape[:-1], width - w)
    return torch.cat([x, fill.to(x.dtype)], dim=-1)


class StandardStream(nn.Module):
    """``x <- x + f(x)``; the state is the hidden tensor."""

    def start(self, x):
        return x

    def read(self, state, site):
        return state

    def write(self, state, site, out):
        return state + out

    def final(self, state):
        return state

    def resize(self, state, width, seen):
        return resize_stream(state, width, seen)


def route_over_depth(sources, query, gain, heads, eps):
    """``sources`` [N, M, d] -> [M, d]: per head ``h``, ``softmax_i(query[h] . RMSNorm(s_i)[h])``
    weights over the ``N`` sources (the norm over the full width, with ``gain``), in fp32."""
    n, m, d = sources.shape
    compute = torch.promote_types(sources.dtype, torch.float32)
    s = sources.to(compute)
    keys = s * torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + eps) * gain.to(compute)
    logits = (keys * query.to(compute)).unflatten(-1, (heads, d // heads)).sum(dim=-1)
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * s.unflatten(-1, (heads, d // heads))).sum(dim=0).reshape(m, d).to(sources.dtype)


class DepthStream(nn.Module):
    """``attnres``: sublayer ``l`` reads a route over the embedding and the earlier outputs (full)
    or the completed block sums and the current block's partial sum (``blocks`` blocks over the
    ``2V`` sublayer sites of ``V`` visits); the final norm reads one more route. ``delta``: the
    standard stream ``p`` is kept and a read is ``p + gate * route``, the first source a learned
    null vector and the blocks groups of sublayers. Sources are stored ``width`` wide (zero past
    a narrower layer's width); a read at width ``w`` routes over their first ``w`` coordinates."""

    def __init__(self, opts, n_sites, eps):
        super().__init__()
        self.delta = opts["kind"] == "delta"
        self.d, self.heads, self.eps, self.n_sites = opts["width"], opts["heads"], eps, n_sites
        n_blocks = opts["blocks"]
        self.full = n_blocks == n_sites
        self.bounds = [(j * n_sites) // n_blocks for j in range(n_blocks + 1)]
        self.block_of = [j for j in range(n_blocks) for _ in range(self.bounds[j], self.bounds[j + 1])]
        self.queries = nn.ParameterList(nn.Parameter(torch.zeros(self.d)) for _ in range(n_sites + 1))
        self.gains = nn.ParameterList(nn.Parameter(torch.ones(self.d)) for _ in range(n_sites + 1))
        if self.delta:
            self.null = nn.Parameter(torch.zeros(self.d))
            self.gates = nn.Parameter(torch.zeros(n_sites + 1))

    def start(self, x):
        rows = x.numel() // x.shape[-1]
        first = self.null.to(x.dtype).expand(rows, self.d) if self.delta else x.reshape(rows, x.shape[-1])
        return {"shape": x.shape, "width": x.shape[-1], "rows": rows, "done": [first], "partial": None,
                "p": x if self.delta else None}

    def _route(self, state, site):
        sources = torch.stack(state["done"] + ([state["partial"]] if state["partial"] is not None else []))
        query, gain, w = self.queries[site], self.gains[site], state["width"]
        if w < self.d:
            sources, query, gain = sources[..., :w], query[:w], gain[:w]
        routed = route_over_depth(sources, query, gain, self.heads, self.eps)
        return routed.view(*state["shape"][:-1], w)

    def read(self, state, site):
        r = self._route(state, site)
        return state["p"] + self.gates[site].to(r.dtype) * r if self.delta else r

    def write(self, state, site, out):
        if self.delta:
            state["p"] = state["p"] + out
        o = out.reshape(state["rows"], out.shape[-1])
        if o.shape[-1] < self.d:
            o = F.pad(o, (0, self.d - o.shape[-1]))
        if self.full:
            state["done"].append(o)
            return state
        j = self.block_of[site]
        state["partial"] = o if site == self.bounds[j] else state["partial"] + o
        if site == self.bounds[j + 1] - 1:
            state["done"].append(state["partial"])
            state["partial"] = None
        return state

    def final(self, state):
        return self.read(state, self.n_sites)

    def resize(self, state, width, seen):
        state["width"] = width
        if state["p"] is not None:
            state["p"] = resize_stream(state["p"], width, seen)
        return state


# ---- a loop's discrete channel ------------------------------------------------------------------------
class DiscreteChannel(nn.Module):
    """Before the first visit of each later loop iteration: ``h + alpha RMSNorm(softmax(W h /
    tau) W)`` with ``W`` the (tied) embedding table; ``alpha`` fixed or, learned, per token
    ``2 alpha sigmoid(w . RMSNorm(h) + b)``."""

    def __init__(self, opts, width, eps):
        super().__init__()
        self.before = set(opts["before"])
        self.tau, self.alpha, self.eps = opts["tau"], opts["alpha"], eps
        self.gate_weight = nn.Parameter(torch.zeros(width)) if opts["learned"] else None
        self.gate_bias = nn.Parameter(torch.zeros(())) if opts["learned"] else None

    def forward(self, h, table):
        logits = h @ table.t()
        probs = torch.softmax(logits / self.tau, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        mixed = probs.to(logits.dtype) @ table
        gate = self.alpha
        if self.gate_weight is not None:
            logit = rms_normalise(h, self.eps).type_as(h) @ self.gate_weight.to(h.dtype)[:, None]
            gate = 2 * self.alpha * torch.sigmoid(logit + self.gate_bias.to(h.dtype))
        return h + gate * rms_normalise(mixed, self.eps).to(h.dtype)


# ---- the decode branch's readout ----------------------------------------------------------------------
def branch_readout(primary, branch, opts):
    """log-probabilities [B, T, V] of the prediction: the mean of the branches' distributions
    (``readout: branch``), or ``alpha p + (1 - alpha) q`` with ``p`` the primary's, ``q`` that
    mean and ``alpha = clamp(sum_v p_v^2, alpha_min, alpha_max)``; in log space, fp32."""
    logq = F.log_softmax(branch.float(), dim=-1)
    logq = logq[0] if logq.shape[0] == 1 else torch.logsumexp(logq, dim=0) - math.log(logq.shape[0])
    if opts["readout"] == "branch":
        return logq
    logp = F.log_softmax(primary.float(), dim=-1)
    alpha = torch.exp(torch.logsumexp(2 * logp, dim=-1)).clamp(opts["alpha_min"], opts["alpha_max"])
    tiny = torch.finfo(torch.float32).tiny
    log_a, log_1ma = torch.log(alpha.clamp_min(tiny)), torch.log((1 - alpha).clamp_min(tiny))
    return torch.logaddexp(log_a[..., None] + logp, log_1ma[..., None] + logq)


class ArchlabDecoder(nn.Module):
    """Embedding(s), the layers in ``visits`` order over the residual stream, the final norm and
    the head."""

    def __init__(self, config):
        super().__init__()
        layout = config.layout
        eps = layout["norm_eps"]
        self.layout = layout
        self.vocab_size = config.vocab_size
        self.tok_emb = nn.Embedding(config.vocab_size, layout["base_width"])
        self.branch = layout.get("branch")
        if self.branch is not None:  # one table per branch, stacked
            self.branch_emb = nn.Embedding(self.branch["n_branches"] * config.vocab_size, layout["base_width"])
        self.norms = norm_sites(layout, eps)
        specs = layout["layers"]
        self.visits = list(layout["visits"])
        residual = layout.get("residual") or {"kind": "standard"}
        self.residual = StandardStream() if residual["kind"] == "standard" else \
            DepthStream(residual, 2 * len(self.visits), eps)
        self.layers = nn.ModuleList(Block(i, s, self.norms, layout["ffn"], self.branch, eps)
                                    for i, s in enumerate(specs))
        final_width = specs[self.visits[-1]]["d"]
        self.norm = self.norms.site(len(specs), "final", final_width)
        self.lm_head = None if layout["tie_embeddings"] else nn.Linear(final_width, config.vocab_size, bias=False)
        channel = layout.get("channel")
        # named as in archlab (the schedule's module "between" visits), so the tensors keep their names
        self.between = DiscreteChannel(channel, layout["base_width"], eps) if channel else None

    def run(self, x, rope, taps, allowed):
        """Embedded rows ``x`` through every visit; the final-normed hidden state."""
        state, width, seen = self.residual.start(x), x.shape[-1], []
        for visit, layer in enumerate(self.visits):
            if self.between is not None and visit in self.between.before:
                state = self.between(state, self.tok_emb.weight)
            d = self.layout["layers"][layer]["d"]
            if d != width:
                width = d
                state = self.residual.resize(state, width, seen)
            block = self.layers[layer]
            out = block.attention(self.residual.read(state, 2 * visit), rope, taps, visit, allowed)
            state = self.residual.write(state, 2 * visit, out)
            out = block.feed_forward(self.residual.read(state, 2 * visit + 1), taps, visit)
            state = self.residual.write(state, 2 * visit + 1, out)
        return self.norm(self.residual.final(state))

    def head(self, h):
        return F.linear(h, self.tok_emb.weight if self.lm_head is None else self.lm_head.weight)

    def forward(self, input_ids, attention_mask=None):
        """Logits [B, T, V]. A row left-padded (``attention_mask`` 0 before its tokens) counts its
        positions from its first token and no query sees a padding key, so its tokens get the
        logits the unpadded sequence gets; the padding positions' own outputs mean nothing."""
        b, t = input_ids.shape
        if t > self.layout["max_seq_len"]:
            raise ValueError(f"{t} tokens exceed the model's max_seq_len {self.layout['max_seq_len']}")
        device = input_ids.device
        if attention_mask is None or bool(attention_mask.all()):
            positions, allowed = torch.arange(t, device=device), None
        else:
            keys = attention_mask.bool()
            positions = (keys.long().cumsum(-1) - 1).clamp_min(0)
            causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
            # each query sees itself too, so a padding query's softmax is never over nothing
            allowed = ((causal[None] & keys[:, None, :]) | torch.eye(t, dtype=torch.bool, device=device))[:, None]
        dims = {s["head_dim"] for s in self.layout["layers"]}
        rope = {hd: rope_tables(hd, positions, self.layout["rope_theta"]) for hd in dims}
        if self.branch is None:
            return self.head(self.run(self.tok_emb(input_ids), rope, PlainTaps(), allowed))
        record = RecordingTaps()
        primary = self.head(self.run(self.tok_emb(input_ids), rope, record, allowed))
        r = self.branch["n_branches"]
        offsets = torch.arange(r, device=input_ids.device) * self.vocab_size
        followers = self.branch_emb((input_ids[None] + offsets[:, None, None]).flatten(0, 1))
        blocks = [self.layers[layer] for layer in self.visits]
        branch = self.head(self.run(followers, rope, FollowerTaps(blocks, record), allowed))
        return branch_readout(primary, branch.view(r, *primary.shape), self.branch)


class ArchlabPreTrainedModel(PreTrainedModel):
    config_class = ArchlabConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def _init_weights(self, module):
        # Every tensor comes from the exported checkpoint; nothing is drawn.
        pass


class ArchlabForCausalLM(ArchlabPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = ArchlabDecoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.tok_emb

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        logits = self.model(input_ids, attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # No KV cache: every step runs the whole sequence so far.
        return {"input_ids": input_ids, "attention_mask": attention_mask}
