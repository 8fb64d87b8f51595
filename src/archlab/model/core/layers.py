"""The baseline's layers: RMSNorm sites, RoPE, the static KV cache and grouped-query attention.

Each is the core kind of a slot (``norm: rmsnorm``, ``position: rope``) or the attention every
layer has; each initialises its own parameters (``init_parameters``) and states its own cost
(``cost``). Attention is where the decode branch's follower rows differ (``Context.rows``): they
query with the shared ``W_Q`` but compute no keys/values, reading the primary's instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archlab.model.core.context import Context
from archlab.model.core.cost import Cost

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec

# enable_gqa arrived in torch 2.5; older versions get the keys/values repeated per query head.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)

try:  # the decode-attention kernel needs Triton; without it decode runs on SDPA
    from archlab.kernels.decode_attention import decode_attention as _decode_attention_kernel
except ImportError:
    _decode_attention_kernel = None

try:  # the skinny-matmul kernel needs Triton too; without it every product runs on cuBLAS
    from archlab.kernels.skinny_matmul import MAX_ROWS as _SKINNY_MAX_ROWS
    from archlab.kernels.skinny_matmul import skinny_matmul as _skinny_matmul_kernel
except ImportError:
    _skinny_matmul_kernel, _SKINNY_MAX_ROWS = None, 0

try:  # and the decode step's fused RoPE + cache-write kernel; without it, inductor's kernels
    from archlab.kernels.rope_cache import rope_cache as _rope_cache_kernel
except ImportError:
    _rope_cache_kernel = None


# ---- linear maps ---------------------------------------------------------------------------------
# Which kernel multiplies a decode step's few rows (at most ``kernels.skinny_matmul.MAX_ROWS``: the
# batch times the rows per sequence) by a weight: "cublas" (``F.linear``), "triton", archlab's
# weight-streaming GEMV (``kernels.skinny_matmul``), or "auto": the kernel on CUDA where it was
# measured faster than cuBLAS, products of at most ``AUTO_MAX_ROWS`` rows into at most
# ``AUTO_MAX_OUT`` features. On an H200 (docs/benchmarks.md, ninth session, call G) it took 2.7
# and 4.2 us for a 124m layer's 768-wide ``wo`` and ``w_down`` at one row, where cuBLAS took 4.3
# and 7.4 us (3.1 and 4.8 against 4.2 and 7.2 at two rows); for the 2048- to 50304-wide outputs
# of every other weight of 124m and 1b it was as fast or slower, by up to 1.6x at two rows.
# Products with more rows (prefill, training) and any that need gradients always run on cuBLAS.
# Read when a step is traced: set it before compiling.
DECODE_LINEAR = "auto"
DECODE_LINEAR_MODES = ("auto", "cublas", "triton")
AUTO_MAX_ROWS = 2
AUTO_MAX_OUT = 1024


def skinny_matmul_for(device: torch.device, rows: int, out_features: int) -> bool:
    """Whether ``DECODE_LINEAR`` puts a product of ``rows`` rows into ``out_features`` on
    ``device`` on the skinny-matmul kernel."""
    if DECODE_LINEAR not in DECODE_LINEAR_MODES:
        raise ValueError(f"DECODE_LINEAR must be one of {DECODE_LINEAR_MODES}, not {DECODE_LINEAR!r}")
    if DECODE_LINEAR == "triton" and _skinny_matmul_kernel is None:
        raise RuntimeError("DECODE_LINEAR='triton' needs triton (pip install 'archlab[triton]')")
    if _skinny_matmul_kernel is None or not 0 < rows <= _SKINNY_MAX_ROWS:
        return False
    if DECODE_LINEAR == "auto":
        return device.type == "cuda" and rows <= AUTO_MAX_ROWS and out_features <= AUTO_MAX_OUT
    return DECODE_LINEAR == "triton"


def _on_skinny_kernel(x: Tensor, weight: Tensor) -> bool:
    """Whether the product of ``x``'s rows by ``weight`` goes to the skinny-matmul kernel: where
    ``DECODE_LINEAR`` picks it for this many rows into this many features, the weight's rows are
    contiguous, and nothing needs gradients."""
    return (skinny_matmul_for(x.device, x.numel() // max(1, x.shape[-1]), weight.shape[0])
            and weight.stride(-1) == 1
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` (no bias), on the kernel ``DECODE_LINEAR`` picks for a product this
    skinny (never for one that needs gradients)."""
    if _on_skinny_kernel(x, weight):
        return _skinny_matmul_kernel(x, weight)
    return F.linear(x, weight)


# Whether a decode step's SwiGLU hands ``[gate | up]`` to ``w_down``'s skinny-matmul kernel, which
# gates as it loads (``skinny_matmul(..., gated=True)``): "fused", or "unfused" (inductor's
# ``silu(gate) * up`` kernel, then the product). Only where ``DECODE_LINEAR`` puts ``w_down`` on
# the kernel, and only in a pass whose taps change nothing (the decode branch couples its rows at
# the gated activation, so its passes stay unfused). The default stays "unfused" until a GPU
# measures the fused path faster. Read when a step is traced: set it before compiling.
DECODE_SWIGLU = "unfused"
DECODE_SWIGLU_MODES = ("fused", "unfused")


def gated_linear(h: Tensor, weight: Tensor) -> Tensor | None:
    """``(silu(gate) * up) @ weight.T`` for SwiGLU's ``h = [gate | up]`` in one kernel launch, where
    ``DECODE_SWIGLU`` and ``DECODE_LINEAR`` put that product on the skinny-matmul kernel; None
    elsewhere (the caller gates and multiplies as usual)."""
    if DECODE_SWIGLU not in DECODE_SWIGLU_MODES:
        raise ValueError(f"DECODE_SWIGLU must be one of {DECODE_SWIGLU_MODES}, not {DECODE_SWIGLU!r}")
    if DECODE_SWIGLU == "unfused" or h.shape[-1] != 2 * weight.shape[1] or not _on_skinny_kernel(h, weight):
        return None
    return _skinny_matmul_kernel(h, weight, True)  # gated


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose decode-step products may run on the skinny-matmul
    kernel (``linear``); its parameters and state dict are ``nn.Linear``'s."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight)


# ---- norms ---------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much at large widths.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)

    def init_parameters(self, init: "Init") -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)


class RMSNormSites(nn.Module):
    """The ``norm`` slot's core kind: an RMSNorm with its own gain before each sublayer and before
    the unembedding; nothing at the sublayer outputs.

    A norm kind builds the module of each site: ``attn_in``, ``mlp_in`` (the pre-norms),
    ``attn_out``, ``mlp_out`` (after a sublayer, before the residual; None here) and ``final``.
    It is itself a module of the model, so a kind that shares parameters across sites holds them.
    """

    SITES = ("attn_in", "attn_out", "mlp_in", "mlp_out", "final")

    def __init__(self, cfg: "ModelConfig"):
        super().__init__()
        self.eps = cfg.norm_eps

    def site(self, spec: "LayerSpec | None", name: str, width: int) -> nn.Module | None:
        if name in ("attn_out", "mlp_out"):
            return None
        return RMSNorm(width, self.eps)

    @classmethod
    def cost(cls, cfg: "ModelConfig", name: str, width: int) -> Cost:
        return Cost() if name in ("attn_out", "mlp_out") else Cost(params=width)


# ---- positions -----------------------------------------------------------------------------------
def rope_tables(head_dim: int, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin of shape [*positions.shape, head_dim/2] in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.to(torch.float32)[..., None] * inv
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved-free halves (the Llama/HF convention) of x [B, H, T, hd].

    cos/sin are [T, hd/2] (shared positions) or [B, T, hd/2] (per-row positions); an ``x`` with a
    multiple of B rows (follower rows stacked after the primary's) repeats them.

    The rotation is computed over ``x`` as [B, T, H, hd] (the projection's order) and returned as
    a [B, H, T, hd] view of that. Laid out [B, H, T, hd] instead, the rotated q and k reach
    attention in an order the projection's gradient does not have: cuDNN's backward returns dq
    and dk in their inputs' layout, and inductor transposed them back while concatenating
    [dq; dk; dv] for the weight gradient, a 3.2 ms gather per 124m training step on an H100
    (profiled, docs/benchmarks.md). The values are the same either way; the step-time gain on
    the GPU is not measured yet.
    """
    if cos.dim() == 2:
        cos, sin = cos[None, :, None], sin[None, :, None]
    else:
        if cos.shape[0] != x.shape[0]:
            reps = x.shape[0] // cos.shape[0]
            cos, sin = cos.repeat(reps, 1, 1), sin.repeat(reps, 1, 1)
        cos, sin = cos[:, :, None], sin[:, :, None]
    xf = x.transpose(1, 2).float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x).transpose(1, 2)


class RopeTables(dict):
    """cos/sin per head dim for the positions of one run; ``rotate`` applies them."""

    def rotate(self, x: Tensor, head_dim: int) -> Tensor:
        cos, sin = self[head_dim]
        return apply_rope(x, cos, sin)


class RoPE(nn.Module):
    """The ``position`` slot's core kind: rotary embeddings (theta ``rope_theta``) per head dim."""

    def __init__(self, cfg: "ModelConfig", specs: "list[LayerSpec]"):
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.head_dims = sorted({s.head_dim for s in specs})
        # cos/sin for every position up to max_seq_len, computed once. Computed inside the forward
        # instead, torch.compile fuses the arange/pow/cos/sin into every rotation kernel and
        # evaluates the transcendentals per element of q and k, in forward and backward: about a
        # quarter of a 124m training step on an H200 (docs/benchmarks.md).
        positions = torch.arange(cfg.max_seq_len)
        for hd in self.head_dims:
            cos, sin = rope_tables(hd, positions, cfg.rope_theta)
            self.register_buffer(f"cos_{hd}", cos, persistent=False)
            self.register_buffer(f"sin_{hd}", sin, persistent=False)

    def tables(self, positions: Tensor | int) -> RopeTables:
        """For positions ``0..positions-1`` (an int) or at the given positions (a tensor)."""
        out = RopeTables()
        for hd in self.head_dims:
            cos, sin = getattr(self, f"cos_{hd}"), getattr(self, f"sin_{hd}")
            if isinstance(positions, int):
                if positions > self.max_seq_len:
                    raise ValueError(f"sequence of {positions} tokens exceeds model.max_seq_len={self.max_seq_len}")
                out[hd] = (cos[:positions], sin[:positions])
            else:
                out[hd] = (cos[positions], sin[positions])
        return out


# How a decode step (one new token per row, over the cache) rotates q and k and writes k and v
# into the cache: "torch", as any other run does (``apply_rope``, ``KVCache.write``: inductor makes
# three short kernels of them per layer), "triton", archlab's one kernel for all of it
# (``kernels.rope_cache``), or "auto": the kernel on CUDA when Triton is installed, torch
# elsewhere. The default is "torch": on an H100 (docs/benchmarks.md, thirtieth session) the kernel
# moved batch-1 decode by -0.6% at 124m (branch -2.1%) and +1.5% at 1b (branch +1.9%), one timing
# each, within the noise of one call; under a CUDA graph the three short kernels it replaces were
# not what bounds the step. Read when a step is traced: set it before compiling.
DECODE_ROPE = "torch"
DECODE_ROPE_MODES = ("auto", "torch", "triton")


def rope_cache_for(device: torch.device) -> bool:
    """Whether ``DECODE_ROPE`` puts a decode step's RoPE and cache writes on ``device`` on the
    fused kernel."""
    if DECODE_ROPE not in DECODE_ROPE_MODES:
        raise ValueError(f"DECODE_ROPE must be one of {DECODE_ROPE_MODES}, not {DECODE_ROPE!r}")
    if DECODE_ROPE == "triton" and _rope_cache_kernel is None:
        raise RuntimeError("DECODE_ROPE='triton' needs triton (pip install 'archlab[triton]')")
    if DECODE_ROPE == "torch" or _rope_cache_kernel is None:
        return False
    return DECODE_ROPE == "triton" or device.type == "cuda"


# ---- attention -----------------------------------------------------------------------------------
# Where grouped decode on SDPA (``DECODE_ATTENTION = "sdpa"``) puts a sequence's follower rows (the
# decode branch) in its one attention call over the cache: "heads", as more query heads of one
# query each (grouped-query attention over the same key/value heads), which keeps SDPA's 1-query
# decode kernel (the default), or "time", as more queries of the sequence, where cuDNN picks a
# prefill kernel with 64-row query tiles. Measured on an H200 (docs/benchmarks.md, eighth
# session), branch / baseline decode at batch 1: 1.17 with "heads" against 1.51 with "time" at
# 124m, 1.09 against 1.33 at 1b. Read when a step is traced: set it before compiling.
GROUPED_DECODE = "heads"
GROUPED_DECODE_MODES = ("time", "heads")

# Which kernel a decode step's attention over the cache runs (one new position per sequence, any
# number of rows per sequence), and so do a prefill's appended query-only rows: "triton",
# archlab's decode kernel (``kernels.decode_attention``: reads only the filled slots, once for
# every row and query head that shares them, no mask), "sdpa", PyTorch's SDPA under the boolean
# mask (rows placed by ``GROUPED_DECODE``), or "auto": the kernel on CUDA when Triton is
# installed, SDPA elsewhere (on CPU the kernel runs only in Triton's interpreter, for tests).
# Read when a step is traced: set it before compiling.
DECODE_ATTENTION = "auto"
DECODE_ATTENTION_MODES = ("auto", "sdpa", "triton")


def decode_kernel_for(device: torch.device):
    """The decode-attention kernel ``DECODE_ATTENTION`` picks for tensors on ``device``, or None
    for SDPA."""
    if DECODE_ATTENTION not in DECODE_ATTENTION_MODES:
        raise ValueError(f"DECODE_ATTENTION must be one of {DECODE_ATTENTION_MODES}, not {DECODE_ATTENTION!r}")
    if DECODE_ATTENTION == "sdpa" or (DECODE_ATTENTION == "auto" and device.type != "cuda"):
        return None
    if _decode_attention_kernel is None and DECODE_ATTENTION == "triton":
        raise RuntimeError("DECODE_ATTENTION='triton' needs triton (pip install 'archlab[triton]')")
    return _decode_attention_kernel


def _split_counters(ctx: Context) -> Tensor | None:
    """The decode kernel's split counters: the KV cache's, when the run has one."""
    return ctx.cache.split_counters if ctx.cache is not None else None


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
         sink: Tensor | None = None) -> Tensor:
    """Scaled dot-product attention with grouped-query heads (k/v may have fewer heads).

    ``sink`` [H]: one more key per head, its logit ``sink[h]`` and its value zero: the softmax
    can put weight on "nothing" (attention sinks). Realised as a zero key and value prepended to
    ``k``/``v`` (a zero key scores exactly 0) and a float mask that adds ``sink[h]`` to that score
    and ``-inf`` where ``mask``/``causal`` forbid.
    """
    if sink is not None and mask is None and causal and q.shape[2] == k.shape[2]:
        return _causal_sdpa_with_sink(q, k, v, sink)
    if sink is not None:
        t, s = q.shape[2], k.shape[2]
        if mask is None:  # causal over the run's own keys (aligned to the last query)
            allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t) if causal else None
        else:
            allowed = mask
        zeros = k.new_zeros(*k.shape[:2], 1, k.shape[3])
        k, v = torch.cat([zeros, k], dim=2), torch.cat([zeros, v], dim=2)
        bias = torch.zeros(*((allowed.shape[:-1]) if allowed is not None else (t,)), s, device=q.device,
                           dtype=q.dtype)
        if allowed is not None:
            bias = bias.masked_fill(~allowed, float("-inf"))
        while bias.dim() < 4:
            bias = bias[None]
        sink_col = sink.to(q.dtype).view(1, -1, 1, 1).expand(bias.shape[0], -1, bias.shape[2], 1)
        mask = torch.cat([sink_col, bias.expand(bias.shape[0], sink.shape[0], *bias.shape[2:])], dim=-1)
        causal = False
    if k.shape[1] != q.shape[1]:
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def _causal_sdpa_with_sink(q: Tensor, k: Tensor, v: Tensor, sink: Tensor) -> Tensor:
    """Causal attention with a sink, kept on the fused (flash / cuDNN) kernels.

    A float mask would push SDPA onto a slower kernel (measured 0.60x training throughput at
    124m on an H200), so the sink becomes one more key that the causal kernel can see:
    - the head dimension grows by one (padded to a multiple of 8 with zeros, which change no dot
      product): the queries carry ``sink[h] / scale`` there, every real key 0 and the sink key 1,
      so the sink key scores exactly ``sink[h]`` for every query of head ``h`` (and grouped-query
      heads still share their keys);
    - the sink key and a zero dummy query are prepended on the time axis, so the square causal
      mask lets query ``i + 1`` see the sink and keys ``0..i`` (``is_causal`` aligns a longer key
      axis to the top-left, so prepending the key alone would hide each query's own key);
    - the sink's value is zero, and the dummy query's output is dropped.
    """
    b, h, t, hd = q.shape
    pad = 8 - hd % 8
    scale = hd ** -0.5
    sink_col = (sink.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, t, 1)
    qa = torch.cat([q, sink_col, q.new_zeros(b, h, t, pad - 1)], dim=-1)
    ka = F.pad(k, (0, pad))
    va = F.pad(v, (0, pad))
    sink_key = k.new_zeros(b, k.shape[1], 1, hd + pad)
    sink_key[..., hd] = 1
    qa = F.pad(qa, (0, 0, 1, 0))
    ka = torch.cat([sink_key, ka], dim=2)
    va = F.pad(va, (0, 0, 1, 0))
    gqa = {"enable_gqa": True} if k.shape[1] != h else {}
    if gqa and not _SDPA_HAS_GQA:
        rep = h // k.shape[1]
        ka, va, gqa = ka.repeat_interleave(rep, dim=1), va.repeat_interleave(rep, dim=1), {}
    o = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=scale, **gqa)
    return o[:, :, 1:, :hd]


class KVCache(nn.Module):
    """Static per-visit key/value buffers [B, kv_heads, max_len, head_dim] (gpt-fast style).

    Entry ``i`` belongs to visit ``i`` of the layer schedule (``Context.visit``), not to a layer: a
    layer that a schedule runs twice writes two entries. For the sequential schedule visit ``i``
    is layer ``i``.

    Row ``b`` holds one sequence, its token at position ``p`` in slot ``p``: every row has its own
    length, so sequences join and leave a running batch without moving anything (continuous
    batching), and a step's writes and reads have static shapes (CUDA graphs).
    """

    def __init__(self, shapes: list[tuple[int, int]], batch: int, max_len: int, device, dtype):
        super().__init__()
        self.max_len = max_len
        self.batch = batch
        for i, (kvh, hd) in enumerate(shapes):
            self.register_buffer(f"k{i}", torch.zeros(batch, kvh, max_len, hd, device=device, dtype=dtype),
                                 persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(batch, kvh, max_len, hd, device=device, dtype=dtype),
                                 persistent=False)
        self.n_layers = len(shapes)
        # The decode-attention kernel's split counters (``kernels.decode_attention``): every launch
        # leaves them zero, so one buffer serves every visit of every step.
        self.register_buffer("split_counters", torch.zeros(batch * max((kvh for kvh, _ in shapes), default=1),
                                                           dtype=torch.int32, device=device), persistent=False)

    def layer(self, i: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Entry (visit) ``i``'s keys and values of cache ``rows`` (all rows when None)."""
        kc, vc = getattr(self, f"k{i}"), getattr(self, f"v{i}")
        return (kc, vc) if rows is None else (kc[rows], vc[rows])

    def write(self, i: int, positions: Tensor, k: Tensor, v: Tensor, rows: Tensor | None = None) -> None:
        """Keys/values ``k``, ``v`` [B, H, T, hd] of tokens at ``positions`` [B, T] into cache ``rows``."""
        kc, vc = getattr(self, f"k{i}"), getattr(self, f"v{i}")
        if rows is None:
            rows = torch.arange(k.shape[0], device=k.device)
        # Index tensors on dims 0 and 2 around a slice: the indexed view is [B, T, H, hd].
        kc[rows[:, None], :, positions] = k.transpose(1, 2).to(kc.dtype)
        vc[rows[:, None], :, positions] = v.transpose(1, 2).to(vc.dtype)


class Attention(nn.Module):
    """GQA self-attention with one fused [q; k; v] projection; follower rows query only."""

    def __init__(self, spec: "LayerSpec"):
        super().__init__()
        self.layer = spec.layer
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.q_dim, self.kv_dim = spec.q_dim, spec.kv_dim
        # One fused [q; k; v] projection: one matmul for primary rows. Follower rows use only its
        # query rows (they compute no keys/values).
        self.wqkv = Linear(spec.d, self.q_dim + 2 * self.kv_dim)
        self.wo = Linear(self.q_dim, spec.d)
        # 1-D, so weight decay skips it like the norms' gains
        self.sink = nn.Parameter(torch.zeros(spec.n_heads)) if spec.sinks else None

    def init_parameters(self, init: "Init") -> None:
        init.linear(self.wqkv.weight, role="in")
        init.linear(self.wo.weight, role="out")
        if self.sink is not None:
            with torch.no_grad():
                self.sink.zero_()  # one extra logit of 0: the sink starts as a plain extra key

    @classmethod
    def cost(cls, cfg: "ModelConfig", spec: "LayerSpec") -> Cost:
        params = spec.d * (2 * spec.q_dim + 2 * spec.kv_dim)
        return Cost(params=params + (spec.n_heads if spec.sinks else 0), flops=2 * params,
                    flops_follower=2 * (params - 2 * spec.d * spec.kv_dim),
                    score_flops_per_key=4 * spec.q_dim, kv_elems=2 * spec.kv_dim)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        rows = x.shape[0]
        lead = ctx.rows.lead(rows)
        appended = ctx.rows.appended  # query-only positions at the end of the time axis
        w = self.wqkv.weight
        k = v = None
        if lead:
            # Primary rows, with any followers stacked after them (grouped decode): one matmul
            # reads every weight once for all rows; the followers' keys/values are dropped
            # (computing them costs no extra bytes, a second matmul would cost a launch).
            q, k, v = self.wqkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
            if lead < rows:
                k, v = k[:lead], v[:lead]
        else:  # followers alone: queries from the shared W_Q, no keys/values of their own
            q = linear(x, w[: self.q_dim])
        q_tail = None
        if appended:
            # Query-only rows at the end of the time axis: their keys/values (free in the one
            # matmul) are dropped before rotating, and their queries are tapped and rotated (at
            # their own positions, ``appended_rope``) apart from the ordinary rows, whose q/k/v
            # are then produced exactly as the baseline's (rotating all T + a rows at gathered
            # positions and slicing made inductor rotate k twice, copy q once more and gather
            # every rotation's table per element: +7 kernels and about 10 us per 124m layer,
            # profiled on the H200).
            t = q.shape[1] - appended
            q, q_tail = q[:, :t], q[:, t:]
            q_tail = ctx.rows.tap_appended(ctx.visit, "q", q, q_tail)
            q_tail = ctx.rows.appended_rope.rotate(self._heads(q_tail, self.n_heads), self.head_dim)
            if k is not None:
                k, v = k[:, :t], v[:, :t]
        else:
            q = ctx.rows.tap(ctx.visit, "q", q)
        if k is not None and self._fused_decode_rope(q, ctx, lead):
            cos, sin = ctx.rope[self.head_dim]
            kc, vc = ctx.cache.layer(ctx.visit)
            q = _rope_cache_kernel(q, k, v, cos, sin, ctx.positions, ctx.cache_rows, kc, vc, self.n_heads)
            k = None  # written: attention reads the cache below
        else:
            q = ctx.rope.rotate(self._heads(q, self.n_heads), self.head_dim)
        if k is not None:
            k = ctx.rope.rotate(self._heads(k, self.n_kv_heads), self.head_dim)
            v = self._heads(v, self.n_kv_heads)
            if ctx.cache is not None:
                ctx.cache.write(ctx.visit, ctx.positions, k, v, ctx.cache_rows)
        if ctx.cache is not None and ctx.mask is not None:  # attend over the cache, not the run's own K/V
            k, v = ctx.cache.layer(ctx.visit, ctx.cache_rows)
        k, v = ctx.rows.share(ctx.visit, "kv", (k, v) if k is not None else None)
        o = ctx.rows.attend(ctx.visit, self, q, k, v, ctx, lead, q_tail)
        return self.wo(o.transpose(1, 2).reshape(rows, o.shape[2], self.q_dim))

    def _fused_decode_rope(self, q: Tensor, ctx: Context, lead: int) -> bool:
        """Whether this run's RoPE and cache writes go to the fused kernel (``DECODE_ROPE``): a
        decode step (one position per row, over the cache, no appended rows) with the core RoPE's
        tables at each sequence's position, and every row a primary or a follower of one."""
        if q.shape[1] != 1 or ctx.cache is None or ctx.mask is None or ctx.rows.appended:
            return False
        if type(ctx.rope) is not RopeTables or not rope_cache_for(q.device):
            return False
        cos = ctx.rope[self.head_dim][0]
        return (cos.dim() == 3 and cos.shape[:2] == (lead, 1) and q.shape[0] % lead == 0
                and ctx.positions is not None and ctx.positions.shape == (lead, 1))

    def _grouped_decode(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context, g: int) -> Tensor:
        """Grouped decode: ``g`` rows per sequence (primary, then followers), one new token each,
        all reading that sequence's cache once, in one attention call.

        ``GROUPED_DECODE`` says where the rows go (module doc of the constant); either way the
        cache is read once per sequence and the result is the same up to rounding."""
        batch, h, hd = k.shape[0], q.shape[1], q.shape[3]
        rows = q.view(g, batch, h, hd).permute(1, 2, 0, 3)  # [B, H, g, hd]: a sequence's rows
        if GROUPED_DECODE == "time":
            # As g queries of one sequence (a view, no copy) under its one-query mask.
            o = sdpa(rows, k, v, mask=ctx.mask, sink=self.sink)
            return o.permute(2, 0, 1, 3).reshape(g * batch, h, 1, hd)
        # As g times the query heads, one query each: head j's rows are heads j*g .. j*g+g-1, which
        # grouped-query attention maps onto head j's key/value head, so no key or value is copied.
        sink = None if self.sink is None else self.sink.repeat_interleave(g)
        o = sdpa(rows.reshape(batch, h * g, 1, hd), k, v, mask=ctx.mask, sink=sink)
        return o.view(batch, h, g, hd).permute(2, 0, 1, 3).reshape(g * batch, h, 1, hd)

    def _decode_kernel(self, kernel, q: Tensor, k: Tensor, v: Tensor, ctx: Context, g: int) -> Tensor:
        """Decode attention on archlab's kernel: a sequence's ``g`` rows (primary, then followers)
        are ``g`` query rows of it, which see the slots up to its position (``ctx.mask`` is
        exactly that: ``Transformer.cache_context``)."""
        batch, h, hd = k.shape[0], q.shape[1], q.shape[3]
        rows = q.view(g, batch, h, hd).permute(1, 2, 0, 3)  # [B, H, g, hd], a view
        if rows.stride(3) != 1:
            rows = rows.contiguous()
        o = kernel(rows, k, v, ctx.positions, self.sink,  # [B, 1]: every row at its sequence's position
                   counters=_split_counters(ctx))
        return o.permute(2, 0, 1, 3).reshape(g * batch, h, 1, hd)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context, lead: int,
                q_tail: Tensor | None = None) -> Tensor:
        """Attention of every row of ``q`` [R, H, T, hd]; rows past ``lead`` are followers of
        sequence ``row % batch``, which see the same keys/values and mask as that sequence.
        Appended query-only positions (``ctx.rows.appended``: ``q_tail`` [R, H, a, hd]) are
        attended to apart, and their outputs follow the ordinary ones on the time axis."""
        if q_tail is not None:
            if lead != q.shape[0]:
                raise ValueError("appended query-only positions need every row to be a primary row")
            # The ordinary queries keep their own path (the fused causal kernel in a prefill);
            # the few appended ones see their sequence's keys/values up to their position, as
            # decode rows do (the decode kernel, or SDPA under a mask).
            o = self._attend_rows(q, k, v, ctx, lead)
            kernel = decode_kernel_for(q.device)
            if kernel is not None:
                tail = kernel(q_tail, k, v, ctx.rows.appended_positions, self.sink,
                              counters=_split_counters(ctx))
            else:
                slots = torch.arange(k.shape[2], device=q.device)
                mask = (slots <= ctx.rows.appended_positions[:, :, None])[:, None]  # [B, 1, a, S]
                tail = sdpa(q_tail, k, v, mask=mask, sink=self.sink)
            return torch.cat([o, tail], dim=2)
        return self._attend_rows(q, k, v, ctx, lead)

    def _attend_rows(self, q: Tensor, k: Tensor, v: Tensor, ctx: Context, lead: int) -> Tensor:
        batch, t = k.shape[0], q.shape[2]
        if ctx.mask is None:
            # Causal over the sequence; a follower row at t sees its sequence's K/V at <= t, which
            # is the same lower-triangular mask as the primary's own.
            parts = []
            if lead:
                parts.append(sdpa(q[:lead], k, v, causal=True, sink=self.sink))
            if q.shape[0] > lead:
                reps = (q.shape[0] - lead) // batch
                kf, vf = (k, v) if reps == 1 else (k.repeat(reps, 1, 1, 1), v.repeat(reps, 1, 1, 1))
                parts.append(sdpa(q[lead:], kf, vf, causal=True, sink=self.sink))
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        # Cached: fold follower rows into the query-time axis so that every row of a sequence
        # reads that sequence's cache once, in one attention call with the primary rows.
        reps = (q.shape[0] - lead) // batch
        if t == 1 and lead == batch:
            kernel = decode_kernel_for(q.device)
            if kernel is not None:
                return self._decode_kernel(kernel, q, k, v, ctx, 1 + reps)
            if reps:
                return self._grouped_decode(q, k, v, ctx, 1 + reps)
        folded = []
        if lead:
            folded.append(q[:lead])
        if reps:
            qf = q[lead:].view(reps, batch, *q.shape[1:]).permute(1, 2, 0, 3, 4)
            folded.append(qf.reshape(batch, q.shape[1], reps * t, q.shape[3]))
        q_all = torch.cat(folded, dim=2) if len(folded) > 1 else folded[0]
        n = q_all.shape[2] // t
        o = sdpa(q_all, k, v, mask=ctx.mask.repeat(1, 1, n, 1) if n > 1 else ctx.mask, sink=self.sink)
        out = []
        if lead:
            out.append(o[:, :, :t])
        if reps:
            of = o[:, :, t if lead else 0:].view(batch, q.shape[1], reps, t, q.shape[3]).permute(2, 0, 1, 3, 4)
            out.append(of.reshape(reps * batch, q.shape[1], t, q.shape[3]))
        return out[0] if len(out) == 1 else torch.cat(out)
