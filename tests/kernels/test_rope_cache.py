"""The fused RoPE + KV-cache-write kernel of a decode step against a float64 reference, on fresh
random inputs: primary and follower rows, grouped-query heads, cache rows in any order, views of
a fused qkv output, bfloat16; and inside ``torch.compile``, where the op must write the cache
buffers themselves (not a copy) and cost no copy of them."""

from __future__ import annotations

import pytest
import torch

from archlab.model.core.layers import rope_tables

pytestmark = pytest.mark.triton_interpret


@pytest.fixture(scope="module")
def rope_cache(triton_interprets, routing_triton):
    from archlab.kernels import rope_cache as module

    return module


def draw(batch=3, followers=0, heads=4, kv_heads=2, hd=16, slots=10, cache_rows=5, seed=0,
         dtype=torch.float32, shuffle_rows=True):
    """q/k/v as views of one qkv output [R, 1, (H + 2 KVH) hd], tables at random positions, and
    caches full of noise (so an unwritten or misplaced slot shows)."""
    gen = torch.Generator().manual_seed(seed)
    rows = batch * (1 + followers)
    q_dim, kv_dim = heads * hd, kv_heads * hd
    qkv = torch.randn(rows, 1, q_dim + 2 * kv_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    k, v = k[:batch], v[:batch]
    positions = torch.randint(0, slots, (batch, 1), generator=gen)
    positions[0, 0] = slots - 1  # the last slot
    cos, sin = rope_tables(hd, positions, theta=10000.0)  # [B, 1, hd/2], as RoPE.tables gives
    rows_of = torch.randperm(cache_rows, generator=gen)[:batch] if shuffle_rows else None
    k_cache = torch.randn(cache_rows, kv_heads, slots, hd, generator=gen).to(dtype)
    v_cache = torch.randn(cache_rows, kv_heads, slots, hd, generator=gen).to(dtype)
    return q, k, v, cos, sin, positions, rows_of, k_cache, v_cache, heads


def reference(args):
    from archlab.kernels.rope_cache import rope_cache_reference

    q, k, v, cos, sin, positions, rows, kc, vc, heads = args
    kc64, vc64 = kc.double().clone(), vc.double().clone()
    out = rope_cache_reference(q.double(), k.double(), v.double(), cos.double(), sin.double(), positions, rows,
                               kc64, vc64, heads)
    return out, kc64, vc64


def on(device, args):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("followers,heads,kv_heads,hd,shuffle", [
    (0, 4, 2, 16, True), (2, 4, 4, 16, True), (1, 6, 2, 24, False), (0, 1, 1, 8, False), (3, 8, 1, 64, True)])
def test_kernel_equals_float64_rope_and_cache_writes(rope_cache, kernel_device, followers, heads, kv_heads, hd,
                                                     shuffle):
    args = draw(followers=followers, heads=heads, kv_heads=kv_heads, hd=hd, shuffle_rows=shuffle, seed=hd + heads)
    want_q, want_k, want_v = reference(args)
    dev = on(kernel_device, args)
    got = rope_cache.rope_cache(*dev)
    assert got.shape == (args[0].shape[0], heads, 1, hd)
    torch.testing.assert_close(got.cpu().double(), want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dev[7].cpu().double(), want_k, rtol=1e-6, atol=1e-6)  # the rest untouched
    torch.testing.assert_close(dev[8].cpu().double(), want_v, rtol=0, atol=0)


def test_bfloat16_within_one_rounding(rope_cache, kernel_device):
    args = draw(followers=1, dtype=torch.bfloat16, seed=7)
    want_q, want_k, want_v = reference(args)
    dev = on(kernel_device, args)
    got = rope_cache.rope_cache(*dev)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().double(), want_q, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(dev[7].cpu().double(), want_k, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(dev[8].cpu().double(), want_v, rtol=0, atol=0)


def test_mismatched_shapes_are_refused(rope_cache):
    q, k, v, cos, sin, positions, rows, kc, vc, heads = draw()
    with pytest.raises(ValueError, match="rope_cache"):
        rope_cache.rope_cache(q, k, v, cos, sin, positions, rows, kc, vc, heads + 1)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_cache.rope_cache(q, k, v, cos[:, :, :-1], sin[:, :, :-1], positions, rows, kc, vc, heads)
    with pytest.raises(ValueError, match="positions"):
        rope_cache.rope_cache(q, k, v, cos, sin, positions[:2], rows, kc, vc, heads)
    with pytest.raises(ValueError, match="rows of"):
        rope_cache.rope_cache(torch.cat([q, q[:1]]), k, v, cos, sin, positions, rows, kc, vc, heads)


@pytest.mark.compile
def test_inside_torch_compile_the_op_writes_the_cache_in_place_without_copying_it(rope_cache, kernel_device):
    """A decode step's shape: a matmul makes qkv, the op rotates and writes, attention-like code
    reads the cache after it. Compiled and eager agree with the reference, the cache buffers the
    caller holds are the ones written, and the generated code copies neither of them."""
    from torch._inductor.utils import run_and_get_code

    args = draw(followers=1, seed=3)
    want_q, want_k, want_v = reference(args)
    q, k, v, cos, sin, positions, rows, kc, vc, heads = on(kernel_device, args)
    qkv = torch.cat([q, torch.cat([k, k], 0), torch.cat([v, v], 0)], dim=-1)  # the same values, one buffer
    w = torch.eye(qkv.shape[-1], device=kernel_device)
    batch, q_dim, kv_dim = k.shape[0], q.shape[-1], k.shape[-1]

    def step(x, cos, sin, positions, rows, kc, vc):
        qq, kk, vv = (x @ w).split([q_dim, kv_dim, kv_dim], dim=-1)
        out = rope_cache.rope_cache(qq, kk[:batch], vv[:batch], cos, sin, positions, rows, kc, vc, heads)
        return out, kc.sum() + vc.sum()  # reads the written caches

    torch._dynamo.reset()
    (out, total), codes = run_and_get_code(torch.compile(step, fullgraph=True), qkv, cos, sin, positions, rows, kc, vc)
    torch.testing.assert_close(out.cpu().double(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc.cpu().double(), want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc.cpu().double(), want_v, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total.cpu().double(), want_k.sum() + want_v.sum(), rtol=1e-4, atol=1e-3)
    code = "\n".join(codes)
    assert "rope_cache_" in code
    # A copy of either cache would be a new buffer of its shape (then copied back with copy_):
    # the op gets the caller's buffers, and nothing of the cache's size is allocated.
    shape = ", ".join(map(str, kc.shape))
    assert f"empty_strided_{kernel_device.type}(({shape})" not in code, code
    assert "copy_(" not in code and "clone" not in code, code
