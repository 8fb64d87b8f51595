"""The decode-attention kernel equals attention written out in float64, for every way a decode
step can call it: grouped-query heads, several rows per sequence (the decode branch), ragged
lengths from 1 to the whole cache, one split or several (the merge kernel), attention sinks, a
head dimension that is not a power of two, and query/cache views with non-contiguous strides.

The ground truth is an independent float64 loop over sequences and heads; the module's own
eager reference is checked against it too. The kernel runs on CUDA when a GPU is present and in
Triton's CPU interpreter otherwise (conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.triton_interpret


@pytest.fixture(scope="module")
def kernel(triton_interprets):
    from archlab.kernels import decode_attention

    return decode_attention


def attention_float64(q, k, v, lengths, sink=None):
    """Per sequence and query head: softmax over its visible keys (and the sink) of scaled dot
    products, times the values; float64 throughout."""
    b, hq, g, d = q.shape
    rep = hq // k.shape[1]
    out = torch.zeros(b, hq, g, d, dtype=torch.float64)
    for i in range(b):
        n = int(lengths[i])
        for h in range(hq):
            keys, values = k[i, h // rep, :n].double(), v[i, h // rep, :n].double()
            logits = q[i, h].double() @ keys.T / d ** 0.5  # [g, n]
            if sink is not None:
                logits = torch.cat([torch.full((g, 1), float(sink[h]), dtype=torch.float64), logits], dim=1)
                values = torch.cat([torch.zeros(1, d, dtype=torch.float64), values])
            out[i, h] = logits.softmax(-1) @ values
    return out


def draw(b, hq, kvh, g, d, slots, sink, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, g, d, generator=gen)
    k = torch.randn(b, kvh, slots, d, generator=gen)
    v = torch.randn(b, kvh, slots, d, generator=gen)
    lengths = torch.randint(1, slots + 1, (b,), generator=gen)
    lengths[0] = 1  # the shortest possible sequence: its first token only
    if b > 1:
        lengths[-1] = slots  # a full cache
    return q, k, v, lengths, (torch.randn(hq, generator=gen) * 2 if sink else None)


CASES = [  # batch, query heads, kv heads, rows per sequence, head dim, slots, splits, sink
    (3, 4, 4, 1, 16, 40, 1, False),  # plain multi-head, one row
    (2, 8, 2, 1, 32, 150, 1, False),  # grouped-query heads
    (3, 4, 2, 2, 16, 130, 1, True),  # decode branch: two rows per sequence, and sinks
    (2, 6, 3, 3, 24, 300, 3, False),  # head dim 24 (padded to 32), three rows, three splits
    (4, 4, 1, 2, 64, 517, None, True),  # default splits, a length not a multiple of the block
    (2, 2, 2, 1, 16, 70, 2, True),  # splits shorter than a block: an empty split is merged
]


@pytest.mark.parametrize("fused", [False, True], ids=["merge-kernel", "fused-merge"])
@pytest.mark.parametrize("b,hq,kvh,g,d,slots,splits,sink", CASES)
def test_kernel_equals_float64_attention(kernel, kernel_device, b, hq, kvh, g, d, slots, splits, sink, fused):
    q, k, v, lengths, s = draw(b, hq, kvh, g, d, slots, sink)
    want = attention_float64(q, k, v, lengths, s)
    dev = kernel_device
    counters = kernel.split_counters(b * kvh, dev) if fused else None
    got = kernel.decode_attention(q.to(dev), k.to(dev), v.to(dev), (lengths - 1).to(dev),
                                  None if s is None else s.to(dev), splits=splits, counters=counters)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=2e-6)
    if fused:  # the last program of each head left its counter at zero for the next launch
        assert counters.cpu().tolist() == [0] * (b * kvh)
    ref = kernel.decode_attention_reference(q, k, v, lengths - 1, s)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=2e-6)


def test_kernel_reads_strided_views_of_the_cache_and_queries(kernel, kernel_device):
    """The model passes the cache's rows and a permuted view of the queries; only the head
    dimension needs to be contiguous."""
    dev = kernel_device
    q, k, v, lengths, s = draw(2, 4, 2, 2, 16, 96, True, seed=1)
    big_k = torch.randn(3, 2, 128, 16)
    big_k[:2, :, :96] = k
    q_perm = q.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # [B, H, G, D], rows outermost
    assert not q_perm.is_contiguous()
    got = kernel.decode_attention(q_perm.to(dev), big_k[:2, :, :96].to(dev), v.to(dev), (lengths - 1).to(dev),
                                  s.to(dev))
    torch.testing.assert_close(got.cpu().double(), attention_float64(q, k, v, lengths, s), rtol=1e-5, atol=2e-6)


def test_slots_past_the_length_are_never_read(kernel, kernel_device):
    """Non-finite garbage past each sequence's length changes nothing (a mask would multiply
    it by zero and give NaN; the kernel must not load it into a sum at all)."""
    dev = kernel_device
    q, k, v, lengths, _ = draw(3, 4, 2, 2, 16, 200, False, seed=2)
    want = attention_float64(q, k, v, lengths)
    for i, n in enumerate(lengths.tolist()):
        k[i, :, n:] = float("nan")
        v[i, :, n:] = float("inf")
    counters = kernel.split_counters(6, dev)
    for splits, c in ((1, None), (3, None), (3, counters), (8, counters)):
        got = kernel.decode_attention(q.to(dev), k.to(dev), v.to(dev), (lengths - 1).to(dev), splits=splits,
                                      counters=c)
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=2e-6)


def test_bfloat16_inputs_within_bfloat16_rounding(kernel, kernel_device):
    dev = kernel_device
    q, k, v, lengths, s = draw(2, 8, 2, 2, 64, 300, True, seed=3)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    want = attention_float64(q, k, v, lengths, s)
    got = kernel.decode_attention(q.to(dev), k.to(dev), v.to(dev), (lengths - 1).to(dev), s.to(dev), splits=2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().double(), want, rtol=2e-2, atol=2e-2)


def test_default_splits_fill_the_gpu_without_short_splits(kernel):
    assert kernel.default_splits(batch=1, kv_heads=8, slots=4096) == 16
    assert kernel.default_splits(batch=1, kv_heads=12, slots=1140) == 11  # ceil(128 / 12)
    assert kernel.default_splits(batch=1, kv_heads=12, slots=300) == 300 // kernel.MIN_SPLIT
    assert kernel.default_splits(batch=64, kv_heads=8, slots=4096) == 1
    assert kernel.default_splits(batch=1, kv_heads=1, slots=100) == 1


def test_one_counter_buffer_serves_launch_after_launch(kernel, kernel_device):
    """The engine passes one buffer to every layer of every step: each launch must leave it as
    it found it, whatever the shapes and lengths (a counter left at 1 would make the next
    launch merge before its splits are done)."""
    dev = kernel_device
    counters = kernel.split_counters(16, dev)
    for seed, (b, hq, kvh, g, slots, splits) in enumerate([(2, 8, 2, 2, 300, 4), (4, 4, 4, 1, 200, 3),
                                                           (1, 4, 2, 2, 300, 5), (2, 8, 2, 2, 300, 4)]):
        q, k, v, lengths, s = draw(b, hq, kvh, g, 16, slots, seed % 2 == 0, seed=10 + seed)
        got = kernel.decode_attention(q.to(dev), k.to(dev), v.to(dev), (lengths - 1).to(dev),
                                      None if s is None else s.to(dev), splits=splits, counters=counters)
        torch.testing.assert_close(got.cpu().double(), attention_float64(q, k, v, lengths, s), rtol=1e-5, atol=2e-6)
        assert counters.cpu().tolist() == [0] * 16


def test_too_few_counters_are_refused(kernel):
    q = torch.zeros(2, 4, 1, 16)
    kv = torch.zeros(2, 2, 300, 16)
    with pytest.raises(ValueError, match="counters"):
        kernel.decode_attention(q, kv, kv, torch.zeros(2, dtype=torch.long), splits=3,
                                counters=kernel.split_counters(3, "cpu"))


def test_mismatched_shapes_are_refused(kernel):
    q = torch.zeros(2, 6, 1, 16)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.decode_attention(q, torch.zeros(2, 4, 8, 16), torch.zeros(2, 4, 8, 16),
                                torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("splits,fused", [(1, False), (4, False), (4, True)])
def test_each_query_row_may_have_its_own_length(kernel, kernel_device, splits, fused):
    """A prefill's appended follower rows ask ``lengths`` [B, G]: a row shorter than its
    sequence's longest sees only its own slots, including where a whole split lies past it."""
    dev = kernel_device
    q, k, v, _, s = draw(2, 4, 2, 3, 16, 300, True, seed=4)
    lengths = torch.tensor([[1, 300, 40], [299, 7, 130]])
    want = attention_float64_rows(q, k, v, lengths, s)
    counters = kernel.split_counters(4, dev) if fused else None
    got = kernel.decode_attention(q.to(dev), k.to(dev), v.to(dev), (lengths - 1).to(dev), s.to(dev), splits=splits,
                                  counters=counters)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=2e-6)
    ref = kernel.decode_attention_reference(q, k, v, lengths - 1, s)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=2e-6)


def attention_float64_rows(q, k, v, lengths, sink):
    """``attention_float64`` row by row, each row with its own length."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for g in range(q.shape[2]):
        out[:, :, g:g + 1] = attention_float64(q[:, :, g:g + 1], k, v, lengths[:, g], sink)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor compiles user Triton kernels for CUDA only")
@pytest.mark.parametrize("fused", [False, True], ids=["merge-kernel", "fused-merge"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_inside_a_compiled_function(kernel, dtype, fused):
    """The engine calls the kernel inside a ``torch.compile``d step, where inductor compiles it
    itself (a Python float argument once reached the kernel as fp64 there and broke it), and
    replays it in a CUDA graph: the split counters must be zero again after every replay."""
    q, k, v, lengths, s = (t.cuda() if t is not None else None for t in draw(2, 8, 2, 2, 64, 300, True, seed=5))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    counters = kernel.split_counters(4, "cuda") if fused else None
    fn = torch.compile(lambda q, k, v, n, s: kernel.decode_attention(q * 1, k, v, n - 1, s, splits=3,
                                                                     counters=counters), dynamic=False)
    want = attention_float64(q.cpu(), k.cpu(), v.cpu(), lengths.cpu(), s.cpu())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(fn(q, k, v, lengths, s).cpu().double(), want, rtol=tol, atol=tol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, k, v, lengths, s)
    for _ in range(5):
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out.cpu().double(), want, rtol=tol, atol=tol)
        if fused:
            assert counters.cpu().tolist() == [0] * 4
