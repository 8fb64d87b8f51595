"""The appended-rows coupling op: ``x[b, T + r] += a[r] * x[b, lengths[b] - 1]`` in place, on a view
of a wider activation (the q site couples the query part of the fused qkv output), eagerly, as
the Triton kernel (CUDA, or Triton's CPU interpreter here), and inside ``torch.compile`` where
the op must mutate its input rather than a copy the rest of the graph never sees."""

from __future__ import annotations

import pytest
import torch

from archlab.kernels.appended_coupling import couple_appended_


def draw(b=3, t=11, n=2, d=40, wide=64, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(b, t + n, wide, generator=gen).to(dtype)
    a = torch.randn(n, d, generator=gen).to(dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = 1  # the shortest prompt: its first token is the lengths
    lengths[-1] = t  # a prompt that fills the time axis
    return base, a, lengths


def expected(base, a, lengths, d):
    out = base.double().clone()
    n = a.shape[0]
    t = base.shape[1] - n
    for i in range(base.shape[0]):
        for r in range(n):
            out[i, t + r, :d] += a[r].double() * base[i, int(lengths[i]) - 1, :d].double()
    return out


def test_eager_op_adds_the_lengths_rows_into_a_view_in_place():
    base, a, lengths = draw()
    want = expected(base, a, lengths, 40)
    x = base[:, :, :40]  # a view: the first 40 of 64 columns, as q is of the qkv output
    couple_appended_(x, a, lengths)
    torch.testing.assert_close(base.double(), want, rtol=1e-6, atol=1e-6)  # the rest untouched


@pytest.mark.triton_interpret
def test_triton_kernel_equals_the_formula(triton_interprets, kernel_device):
    from archlab.kernels.appended_coupling import launch_kernel

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        base, a, lengths = draw(d=1500, wide=2100, dtype=dtype)  # more columns than one block
        want = expected(base, a, lengths, 1500)
        dev_base = base.to(kernel_device)
        launch_kernel(dev_base[:, :, :1500], a.to(kernel_device), lengths.to(kernel_device))
        torch.testing.assert_close(dev_base.cpu().double(), want, rtol=tol, atol=tol)


@pytest.mark.compile
def test_inside_torch_compile_the_op_mutates_the_activation_the_graph_goes_on_with():
    """q, k, v split from one matmul output; the op couples q's appended rows; k and v are read
    after it. Compiled and eager agree, and both equal the formula."""
    base, a, lengths = draw(d=16, wide=48)
    w = torch.randn(48, 48)

    def f(x, w, a, lengths):
        qkv = x @ w
        q, k, v = qkv.split(16, dim=-1)
        couple_appended_(q, a, lengths)
        return q * 2 + k - v

    eager = f(base, w, a, lengths)
    compiled = torch.compile(f, dynamic=False)(base, w, a, lengths)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    qkv = expected(base @ w, a, lengths, 16)
    q, k, v = qkv.split(16, dim=-1)
    torch.testing.assert_close(eager.double(), q * 2 + k - v, rtol=1e-5, atol=1e-5)


def test_mismatched_shapes_are_refused():
    base, a, lengths = draw()
    with pytest.raises(ValueError, match="couple_appended_"):
        couple_appended_(base[:, :, :39], a, lengths)
