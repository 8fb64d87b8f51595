"""Depth routing (AttnRes / MHAR): reference, compiled and Triton implementations agree.

Ground truth is a float64 loop written independently of the library code (per head, per
source). The reference is checked against it; the compiled and Triton versions against the
reference. Triton runs on CUDA when a GPU is present and in its CPU interpreter otherwise
(conftest.py says how that is arranged; ``kernel_device`` is where it runs). Inputs are seeded
random draws on CPU with non-zero query and non-unit gain (the models' zero-initialised query
would make every routing weight 1/N and hide errors in the logits), moved to ``kernel_device``
for the Triton calls; references run on CPU and results are compared on CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from archlab.errors import ConfigError
from archlab.kernels.routing import available_impls, resolve_impl, route
from archlab.kernels.routing_compiled import route_compiled, route_fused_math
from archlab.kernels.routing_reference import route_reference

EPS = 1e-6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def assert_close_fp32(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to fp32 rounding of a differently ordered reduction (compared on CPU)."""
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-6)


def make_inputs(n: int, m: int, d: int, seed: int, dtype: torch.dtype = torch.float32,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``sources`` [N, M, d], ``query``, ``gain`` [d] and an upstream gradient [M, d].

    Sources get per-row scales so the RMS differs between rows (exercises the norm), the query
    is large enough that the softmax is far from uniform.
    """
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, m, 1, generator=gen) * 2 + 0.2
    sources = (torch.randn(n, m, d, generator=gen) * scale).to(dtype)
    query = torch.randn(d, generator=gen) * 0.5
    gain = 1 + 0.3 * torch.randn(d, generator=gen)
    dout = torch.randn(m, d, generator=gen)
    return sources, query, gain, dout


def loop_route_f64(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent float64 routing: explicit loops over heads and sources; ``(out, alpha)``."""
    s, q, g = sources.double(), query.double(), gain.double()
    n, m, d = s.shape
    width = d // heads
    out = torch.zeros(m, d, dtype=torch.float64)
    alpha = torch.zeros(n, m, heads, dtype=torch.float64)
    for h in range(heads):
        cols = slice(h * width, (h + 1) * width)
        logits = []
        for i in range(n):
            rms = torch.sqrt((s[i] ** 2).mean(dim=1, keepdim=True) + eps)  # full-width RMS
            key = (s[i] / rms * g)[:, cols]
            logits.append(key @ q[cols])
        logit = torch.stack(logits)  # [N, M]
        e = torch.exp(logit - logit.max(dim=0).values)
        a = e / e.sum(dim=0)
        for i in range(n):
            out[:, cols] += a[i][:, None] * s[i][:, cols]
        alpha[:, :, h] = a
    return out, alpha


def grads(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], sources: torch.Tensor,
          query: torch.Tensor, gain: torch.Tensor, heads: int, dout: torch.Tensor,
          device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """``(out, alpha, dsources, dquery, dgain)`` of ``fn`` for the upstream gradient ``dout``.

    ``fn`` runs on ``device`` (copies of the inputs, strides kept); the results come back on CPU.
    """
    s = sources.detach().to(device).clone().requires_grad_()
    q = query.detach().to(device).clone().requires_grad_()
    g = gain.detach().to(device).clone().requires_grad_()
    out, alpha = fn(s, q, g, heads, EPS, return_weights=True)
    out.backward(dout.to(out.device, out.dtype))
    return tuple(t.cpu() for t in (out.detach(), alpha.detach(), s.grad, q.grad, g.grad))


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,m,d,heads", [(1, 4, 16, 1), (3, 6, 48, 4), (7, 5, 64, 8),
                                         (5, 3, 24, 3)])
def test_reference_matches_float64_loops(n: int, m: int, d: int, heads: int) -> None:
    sources, query, gain, _ = make_inputs(n, m, d, seed=n * 100 + d + heads)
    want_out, want_alpha = loop_route_f64(sources, query, gain, heads, EPS)
    out, alpha = route_reference(sources, query, gain, heads, EPS, return_weights=True)
    assert out.dtype == torch.float32 and alpha.dtype == torch.float32
    assert alpha.shape == (n, sources.shape[1], heads)
    assert rel_err(out, want_out) < 1e-6
    assert rel_err(alpha, want_alpha) < 1e-6
    out64, alpha64 = route_reference(sources.double(), query.double(), gain.double(), heads, EPS,
                                     return_weights=True)
    assert rel_err(out64, want_out) < 1e-13
    assert rel_err(alpha64, want_alpha) < 1e-13


def test_reference_gradcheck() -> None:
    sources, query, gain, _ = make_inputs(3, 4, 12, seed=7)
    inputs = tuple(x.double().requires_grad_() for x in (sources, query, gain))
    assert torch.autograd.gradcheck(lambda s, q, g: route_reference(s, q, g, 3, EPS), inputs)


def test_single_head_is_attnres() -> None:
    """H = 1 is exactly AttnRes: softmax over sources of w . RMSNorm(s_i), values the raw s_i."""
    sources, query, gain, _ = make_inputs(5, 7, 32, seed=11)
    keys = F.rms_norm(sources, (32,), weight=gain, eps=EPS)
    alpha = torch.softmax(keys @ query, dim=0)  # [N, M]
    want = (alpha[..., None] * sources).sum(dim=0)
    assert rel_err(route_reference(sources, query, gain, 1, EPS), want) < 1e-6
    assert rel_err(route_fused_math(sources, query, gain, 1, EPS)[0], want) < 1e-6
    # and more heads is a different function once the query is not zero
    assert rel_err(route_reference(sources, query, gain, 4, EPS), want) > 1e-3


@pytest.mark.parametrize("n", [3, 4, 5])
def test_zero_query_gives_the_mean(n: int) -> None:
    """Zero-initialised queries make routing a plain average of the sources."""
    sources, _, gain, _ = make_inputs(n, 6, 32, seed=n)
    query = torch.zeros(32)
    out, alpha = route_reference(sources, query, gain, 4, EPS, return_weights=True)
    assert torch.equal(alpha, torch.full_like(alpha, 1.0 / n))
    if n & (n - 1) == 0:  # 1/n exact: weighted sum and mean round identically
        assert torch.equal(out, sources.mean(dim=0))
    torch.testing.assert_close(out, sources.mean(dim=0), rtol=1e-6, atol=1e-6)


def test_bad_arguments_fail_clearly() -> None:
    sources, query, gain, _ = make_inputs(2, 3, 12, seed=0)
    with pytest.raises(ValueError, match="divisor"):
        route_reference(sources, query, gain, 5, EPS)
    with pytest.raises(ValueError, match=r"\[N, M, d\]"):
        route_reference(sources[0], query, gain, 1, EPS)
    with pytest.raises(ValueError, match="query and gain"):
        route_reference(sources, query[:6], gain, 1, EPS)


# ----------------------------------------------------------------------------------------------
# torch.compile path
# ----------------------------------------------------------------------------------------------
def test_compile_body_matches_reference() -> None:
    sources, query, gain, dout = make_inputs(6, 9, 48, seed=3)
    got = grads(lambda *a, return_weights: route_fused_math(*a), sources, query, gain, 4, dout)
    want = grads(route_reference, sources, query, gain, 4, dout)
    for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), got, want):
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.compile
def test_compiled_matches_reference() -> None:
    """One small compile on CPU (Inductor's C++ backend), forward and backward."""
    sources, query, gain, dout = make_inputs(5, 7, 48, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads(route_compiled, sources, query, gain, 4, dout)
    assert not [w for w in caught if "depth routing" in str(w.message)], "compile fell back"
    want = grads(route_reference, sources, query, gain, 4, dout)
    for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), got, want):
        assert rel_err(a, b) < 1e-5, name


# ----------------------------------------------------------------------------------------------
# Triton kernels (on ``kernel_device``: CUDA, or interpreted on CPU)
# ----------------------------------------------------------------------------------------------
TRITON_SHAPES = [(n, m, d, h) for n in (1, 3, 7) for m in (5, 33) for d, h in ((32, 1), (48, 4))]


@pytest.mark.triton_interpret
@pytest.mark.parametrize("n,m,d,heads", TRITON_SHAPES)
def test_triton_matches_reference(routing_triton: ModuleType, kernel_device: torch.device, n: int,
                                  m: int, d: int, heads: int) -> None:
    sources, query, gain, dout = make_inputs(n, m, d, seed=1000 * n + 10 * m + d + heads)
    got = grads(routing_triton.route_triton, sources, query, gain, heads, dout, kernel_device)
    want = grads(route_reference, sources, query, gain, heads, dout)
    for name, a, b in zip(("out", "alpha", "dsources"), got, want):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-5, name
    for name, a, b in zip(("dquery", "dgain"), got[3:], want[3:]):
        if n == 1:  # one source: alpha = 1 whatever the logits, so no gradient reaches them
            assert torch.equal(a, torch.zeros_like(a)) and b.abs().max() < 1e-6, name
        else:
            assert rel_err(a, b) < 1e-5, name


@pytest.mark.triton_interpret
def test_triton_odd_widths_and_many_heads(routing_triton: ModuleType,
                                          kernel_device: torch.device) -> None:
    """Head width not a power of two (d/H = 5), H not a power of two, one position."""
    for n, m, d, heads in ((4, 9, 15, 3), (3, 1, 40, 8), (5, 2, 64, 16)):
        sources, query, gain, dout = make_inputs(n, m, d, seed=d)
        got = grads(routing_triton.route_triton, sources, query, gain, heads, dout, kernel_device)
        want = grads(route_reference, sources, query, gain, heads, dout)
        for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), got, want):
            assert rel_err(a, b) < 1e-5, (n, m, d, heads, name)


@pytest.mark.triton_interpret
def test_triton_no_positions(routing_triton: ModuleType, kernel_device: torch.device) -> None:
    sources, query, gain, _ = make_inputs(3, 0, 16, seed=0)
    out, alpha, dsources, dquery, dgain = grads(routing_triton.route_triton, sources, query, gain,
                                                2, torch.zeros(0, 16), kernel_device)
    assert out.shape == (0, 16) and alpha.shape == (3, 0, 2) and dsources.shape == (3, 0, 16)
    assert not dquery.any() and not dgain.any()


@pytest.mark.triton_interpret
def test_triton_strided_sources(routing_triton: ModuleType, kernel_device: torch.device) -> None:
    """``buf[:n]`` of a preallocated buffer, and a layout strided over N, are used in place."""
    sources, query, gain, dout = make_inputs(9, 6, 32, seed=9)
    want = grads(route_reference, sources[:5], query, gain, 4, dout)
    buf = sources.to(kernel_device, copy=True)
    got = grads(routing_triton.route_triton, buf[:5], query, gain, 4, dout, kernel_device)
    for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), got, want):
        assert rel_err(a, b) < 1e-5, name
    # [N, M, d] view of position-major memory, made on the kernel device (``grads`` keeps strides)
    position_major = buf[:5].transpose(0, 1).contiguous().transpose(0, 1)
    assert not position_major.is_contiguous()
    got = grads(routing_triton.route_triton, position_major, query, gain, 4, dout, kernel_device)
    for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), got, want):
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.triton_interpret
def test_triton_bf16_sources(routing_triton: ModuleType, kernel_device: torch.device) -> None:
    """bf16 sources, fp32 parameters: outputs keep each input's dtype, values match closely."""
    sources, query, gain, dout = make_inputs(5, 33, 48, seed=16, dtype=torch.bfloat16)
    got = grads(routing_triton.route_triton, sources, query, gain, 4, dout, kernel_device)
    want = grads(route_reference, sources, query, gain, 4, dout)
    for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), got, want):
        assert a.dtype == b.dtype, name
        assert rel_err(a, b) < 1e-2, name


@pytest.mark.triton_interpret
def test_triton_zero_query_gives_the_mean(routing_triton: ModuleType,
                                         kernel_device: torch.device) -> None:
    sources, _, gain, _ = make_inputs(4, 33, 48, seed=4)
    out, alpha = routing_triton.route_triton(sources.to(kernel_device),
                                             torch.zeros(48, device=kernel_device),
                                             gain.to(kernel_device), 4, EPS, return_weights=True)
    out, alpha = out.cpu(), alpha.cpu()
    assert torch.equal(alpha, torch.full_like(alpha, 0.25))
    torch.testing.assert_close(out, sources.mean(dim=0), rtol=1e-6, atol=1e-6)


@pytest.mark.triton_interpret
def test_triton_backward_is_deterministic(routing_triton: ModuleType,
                                          kernel_device: torch.device) -> None:
    """query/gain gradients reduce over positions in fixed order: bitwise equal run to run."""
    sources, query, gain, dout = make_inputs(7, 33, 48, seed=21)
    first = grads(routing_triton.route_triton, sources, query, gain, 4, dout, kernel_device)
    second = grads(routing_triton.route_triton, sources, query, gain, 4, dout, kernel_device)
    for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), first, second):
        assert torch.equal(a, b), name


@pytest.mark.triton_interpret
@pytest.mark.parametrize("src_dtype,acc_dtype", [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_triton_backward_accumulates_in_place(routing_triton: ModuleType,
                                              kernel_device: torch.device, src_dtype: torch.dtype,
                                              acc_dtype: torch.dtype) -> None:
    """``accumulate_into`` adds the source gradients to what the buffer holds (a view into a
    larger buffer, as the model passes it); the query and gain gradients are unchanged."""
    n, m, d, heads = 5, 33, 48, 4
    sources, query, gain, dout = make_inputs(n, m, d, seed=31, dtype=src_dtype)
    dout = dout.to(src_dtype)
    dev_args = [t.to(kernel_device) for t in (sources, query, gain)]
    dev_dout = dout.to(kernel_device)
    out, alpha = routing_triton._route_forward(*dev_args, heads, EPS)
    want, _, dquery, dgain = routing_triton.route_backward(*dev_args, alpha, out, dev_dout, heads, EPS)
    big = torch.randn(n + 2, m, d, generator=torch.Generator().manual_seed(32)).to(kernel_device, acc_dtype)
    prior = big[:n].to("cpu", copy=True)  # before the kernel adds to ``big``
    got, _, dquery2, dgain2 = routing_triton.route_backward(*dev_args, alpha, out, dev_dout, heads, EPS,
                                                             accumulate_into=big[:n])
    assert got.data_ptr() == big.data_ptr() and got.dtype == acc_dtype
    # On CUDA the accumulating backward may use another tile (``_tiles``), so its row and
    # position reductions can round differently: equal to fp32 rounding, not bitwise.
    assert_close_fp32(dquery2, dquery)
    assert_close_fp32(dgain2, dgain)
    got, want = got.cpu(), want.cpu()
    if src_dtype == acc_dtype == torch.float32:  # the same fp32 add, in the kernel or here
        assert_close_fp32(got, prior + want)
    else:  # the fp32 sum rounded once to the buffer's dtype; ``want`` was rounded to the sources'
        total = prior.float() + want.float()
        tol = torch.finfo(acc_dtype).eps * total.abs() + torch.finfo(src_dtype).eps * want.float().abs()
        assert ((got.float() - total).abs() <= tol).all()
    assert rel_err(want, grads(route_reference, sources, query, gain, heads, dout)[2]) < 1e-2


def route_with_tail(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]):
    """``fn`` routing over ``s[:-1]`` plus ``s[-1]`` as the tail; gradients flow back into ``s``."""
    def routed(s, q, g, heads, eps, return_weights):
        return fn(s[:-1], q, g, heads, eps, return_weights, tail=s[-1])
    return routed


@pytest.mark.triton_interpret
@pytest.mark.parametrize("n,heads", [(1, 1), (2, 4), (6, 1), (6, 4)])
def test_triton_tail_source_equals_stacked(routing_triton: ModuleType, kernel_device: torch.device,
                                           n: int, heads: int) -> None:
    """A tail source read in place routes (forward and backward) like the same source stacked last."""
    sources, query, gain, dout = make_inputs(n + 1, 17, 48, seed=40 + n + heads)
    got = grads(route_with_tail(routing_triton.route_triton), sources, query, gain, heads, dout,
                kernel_device)
    want = grads(route_reference, sources, query, gain, heads, dout)
    for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), got, want):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.triton_interpret
def test_triton_tail_with_other_strides(routing_triton: ModuleType, kernel_device: torch.device) -> None:
    """Position-major sources (row stride N*d) and a contiguous tail: still the stacked result."""
    sources, query, gain, dout = make_inputs(5, 6, 32, seed=44)
    position_major = sources[:4].to(kernel_device).transpose(0, 1).contiguous().transpose(0, 1)
    tail = sources[4].to(kernel_device)
    out, alpha = routing_triton.route_triton(position_major, query.to(kernel_device),
                                             gain.to(kernel_device), 4, EPS, True, tail=tail)
    want_out, want_alpha = route_reference(sources, query, gain, 4, EPS, return_weights=True)
    assert rel_err(out.cpu(), want_out) < 1e-5 and rel_err(alpha.cpu(), want_alpha) < 1e-5


@pytest.mark.triton_interpret
def test_triton_tail_gradient_is_fresh_when_accumulating(routing_triton: ModuleType,
                                                         kernel_device: torch.device) -> None:
    """With ``accumulate_into`` the stacked sources' gradients are added to the buffer and the
    tail's comes back on its own, equal to the non-accumulating gradient."""
    n, m, d, heads = 4, 9, 48, 2
    sources, query, gain, dout = make_inputs(n + 1, m, d, seed=45)
    dev = [t.to(kernel_device) for t in (sources, query, gain, dout)]
    stack, tail = dev[0][:n], dev[0][n]
    out, alpha = routing_triton._route_forward(stack, dev[1], dev[2], heads, EPS, tail)
    want_ds, want_dt, dq, dg = routing_triton.route_backward(stack, dev[1], dev[2], alpha, out, dev[3],
                                                              heads, EPS, tail=tail)
    big = torch.randn(n + 2, m, d, generator=torch.Generator().manual_seed(46)).to(kernel_device)
    prior = big.to("cpu", copy=True)
    got_ds, got_dt, dq2, dg2 = routing_triton.route_backward(stack, dev[1], dev[2], alpha, out, dev[3],
                                                              heads, EPS, accumulate_into=big[:n],
                                                              tail=tail)
    for a, b in ((got_dt, want_dt), (dq2, dq), (dg2, dg), (big[:n], prior[:n] + want_ds.cpu())):
        assert_close_fp32(a, b)
    assert torch.equal(big[n:].cpu(), prior[n:])  # the tail's gradient went nowhere near the buffer
    ref = grads(route_reference, sources, query, gain, heads, dout.cpu())[2]
    assert rel_err(want_dt.cpu(), ref[n]) < 1e-5 and rel_err(want_ds.cpu(), ref[:n]) < 1e-5


def reader_chain(n_slots: int, counts: list[int], tails: list[bool], m: int, d: int, seed: int):
    """A stack of ``n_slots`` sources read by ``len(counts)`` readers, reader ``r`` over the first
    ``counts[r]`` slots plus, where ``tails[r]``, a tail of its own; each with its own query, gain
    and upstream gradient. Seeded CPU float32 tensors."""
    gen = torch.Generator().manual_seed(seed)
    stack = torch.randn(n_slots, m, d, generator=gen) * (torch.rand(n_slots, m, 1, generator=gen) + 0.3)
    readers = []
    for n, has_tail in zip(counts, tails):
        readers.append(dict(n=n, query=torch.randn(d, generator=gen) * 0.5,
                            gain=1 + 0.3 * torch.randn(d, generator=gen),
                            tail=torch.randn(m, d, generator=gen) if has_tail else None,
                            dout=torch.randn(m, d, generator=gen)))
    return stack, readers


def chain_grads_f64(stack: torch.Tensor, readers: list[dict], heads: int):
    """Float64 autograd through the reference: gradients of ``sum_r <dout_r, out_r>`` for the
    stack, every tail, query and gain."""
    s = stack.double().requires_grad_(True)
    leaves = []
    total = 0
    for r in readers:
        q, g = r["query"].double().requires_grad_(True), r["gain"].double().requires_grad_(True)
        t = None if r["tail"] is None else r["tail"].double().requires_grad_(True)
        src = s[:r["n"]] if t is None else torch.cat([s[:r["n"]], t[None]])
        total = total + (route_reference(src, q, g, heads, EPS) * r["dout"].double()).sum()
        leaves.append((q, g, t))
    total.backward()
    return s.grad, [(q.grad, g.grad, None if t is None else t.grad) for q, g, t in leaves]


@pytest.mark.triton_interpret
@pytest.mark.parametrize("heads,counts,tails", [
    (1, [1, 2, 3, 4, 5], [False] * 5),  # full AttnRes: reader r writes slot r - 1 and reads all so far
    (4, [1, 1, 2, 2, 3], [False, True, False, True, True]),  # Block MHAR: tails between block ends
    (2, [2, 2, 4, 4], [True, False, True, False]),  # a reader writing two slots at once
])
def test_triton_deferred_backward_matches_float64(routing_triton: ModuleType, kernel_device: torch.device,
                                                  heads: int, counts: list[int], tails: list[bool]) -> None:
    """Readers' backwards in reverse order keep their terms (``defer``), then each source's
    gradient is assembled once from all its readers: equal to float64 autograd over the chain,
    as are every tail's, query's and gain's gradients."""
    m, d = 13, 48
    stack, readers = reader_chain(max(counts), counts, tails, m, d, seed=50 + heads)
    want_stack, want = chain_grads_f64(stack, readers, heads)
    dev = stack.to(kernel_device)
    kept = routing_triton.DeferredGrads(len(readers), max(counts), m, d, heads, torch.float32, kernel_device)
    got = [None] * len(readers)
    for r in reversed(range(len(readers))):
        rd = readers[r]
        q, g, dout = (rd[k].to(kernel_device) for k in ("query", "gain", "dout"))
        tail = None if rd["tail"] is None else rd["tail"].to(kernel_device)
        out, alpha = routing_triton._route_forward(dev[:rd["n"]], q, g, heads, EPS, tail)
        ds, dtail, dq, dg = routing_triton.route_backward(dev[:rd["n"]], q, g, alpha, out, dout, heads, EPS,
                                                          tail=tail, defer=kept, reader=r)
        assert ds is None
        got[r] = (dq, dg, dtail)
    for slot in range(max(counts)):
        first = next(r for r, n in enumerate(counts) if n > slot)
        ds = kept.assemble(dev[slot], slot, first, EPS, torch.float32)
        assert rel_err(ds.cpu(), want_stack[slot]) < 1e-5, slot
    for r, ((dq, dg, dt), (wq, wg, wt)) in enumerate(zip(got, want)):
        if counts[r] + tails[r] > 1:  # one source: no gradient reaches the logits
            assert rel_err(dq.cpu(), wq) < 1e-5 and rel_err(dg.cpu(), wg) < 1e-5, r
        assert (dt is None) == (wt is None)
        if dt is not None:
            assert rel_err(dt.cpu(), wt) < 1e-5, r


@pytest.mark.triton_interpret
def test_triton_deferred_reader_without_gradient_adds_nothing(routing_triton: ModuleType,
                                                              kernel_device: torch.device) -> None:
    """A reader skipped (its output got no gradient) contributes zero; one that ran out of
    reverse order is refused; a source whose readers never ran has no gradient."""
    m, d, heads = 7, 32, 2
    stack, readers = reader_chain(3, [1, 2, 3], [False] * 3, m, d, seed=60)
    readers[2]["dout"] = torch.zeros(m, d)  # what skipping it must equal
    want_stack, _ = chain_grads_f64(stack, readers, heads)
    dev = stack.to(kernel_device)
    kept = routing_triton.DeferredGrads(3, 3, m, d, heads, torch.float32, kernel_device)
    assert kept.assemble(dev[0], 0, 0, EPS, torch.float32) is None
    kept.skip(2)
    for r in (1, 0):
        rd = readers[r]
        q, g, dout = (rd[k].to(kernel_device) for k in ("query", "gain", "dout"))
        out, alpha = routing_triton._route_forward(dev[:rd["n"]], q, g, heads, EPS)
        routing_triton.route_backward(dev[:rd["n"]], q, g, alpha, out, dout, heads, EPS, defer=kept, reader=r)
    for slot in range(3):  # slot 2's one reader was skipped: its gradient is zero
        got = kept.assemble(dev[slot], slot, slot, EPS, torch.float32).cpu()
        torch.testing.assert_close(got, want_stack[slot].float(), rtol=1e-5, atol=1e-5)
    assert want_stack[2].abs().max() == 0
    with pytest.raises(RuntimeError, match="reverse forward order"):
        kept.skip(1)


@pytest.mark.parametrize("impl", ["reference", pytest.param("compile", marks=pytest.mark.compile)])
def test_tail_in_other_impls_is_a_stacked_source(impl: str) -> None:
    sources, query, gain, dout = make_inputs(4, 5, 24, seed=47)

    def routed(s, q, g, heads, eps, return_weights, tail):
        return route(s, q, g, heads, eps, impl, return_weights, tail=tail)

    got = grads(route_with_tail(routed), sources, query, gain, 3, dout)
    want = grads(route_reference, sources, query, gain, 3, dout)
    for name, a, b in zip(("out", "alpha", "dsources", "dquery", "dgain"), got, want):
        assert rel_err(a, b) < 1e-5, name


def test_bad_tail_is_rejected() -> None:
    sources, query, gain, _ = make_inputs(3, 5, 16, seed=48)
    with pytest.raises(ValueError, match="tail must be one more source"):
        route(sources, query, gain, 1, EPS, impl="reference", tail=sources[0, :4])
    with pytest.raises(ValueError, match="tail must be one more source"):
        route(sources, query, gain, 1, EPS, impl="reference", tail=sources[0].double())


@pytest.mark.triton_interpret
def test_bad_tail_is_rejected_by_triton(routing_triton: ModuleType, kernel_device: torch.device) -> None:
    sources, query, gain, _ = (t.to(kernel_device) for t in make_inputs(3, 5, 16, seed=48))
    with pytest.raises(ValueError, match="tail must be one more source"):
        routing_triton.route_triton(sources, query, gain, 1, EPS, tail=sources[0, :4])
    with pytest.raises(ValueError, match="tail must have the sources' strides"):
        routing_triton._route_forward(sources, query, gain, 1, EPS, sources[0].t().contiguous().t())


# ----------------------------------------------------------------------------------------------
# Dispatcher
# ----------------------------------------------------------------------------------------------
def test_dispatcher_rejects_unknown_impl() -> None:
    sources, query, gain, _ = make_inputs(2, 3, 8, seed=0)
    with pytest.raises(ConfigError, match="unknown depth-routing impl 'cuda'"):
        route(sources, query, gain, 1, EPS, impl="cuda")


def test_dispatcher_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu) == "reference"
    assert "reference" in available_impls(cpu) and "triton" not in available_impls(cpu)
    sources, query, gain, _ = make_inputs(3, 4, 16, seed=2)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        route(sources, query, gain, 2, EPS, impl="triton")
    assert torch.equal(route(sources, query, gain, 2, EPS),
                       route_reference(sources, query, gain, 2, EPS))


@pytest.mark.triton_interpret
def test_dispatcher_runs_triton(routing_triton: ModuleType, kernel_device: torch.device) -> None:
    """``impl="triton"`` runs the kernels where they run; ``auto`` picks them on CUDA only."""
    assert "triton" in available_impls(kernel_device)
    # the interpreter is never picked implicitly (on a GPU machine CPU tensors get the reference too)
    assert resolve_impl("auto", torch.device("cpu")) == "reference"
    if kernel_device.type == "cuda":
        assert resolve_impl("auto", kernel_device) == "triton"
    sources, query, gain, _ = make_inputs(3, 5, 16, seed=3)
    out, alpha = route(*(t.to(kernel_device) for t in (sources, query, gain)), 2, EPS, impl="triton",
                       return_weights=True)
    assert out.device.type == alpha.device.type == kernel_device.type
    out, alpha = out.cpu(), alpha.cpu()
    want_out, want_alpha = route_reference(sources, query, gain, 2, EPS, return_weights=True)
    assert rel_err(out, want_out) < 1e-5 and rel_err(alpha, want_alpha) < 1e-5
