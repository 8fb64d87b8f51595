"""The skinny-matmul kernel (a decode step's few rows times a weight) against float64: every row
count from 1 to ``MAX_ROWS`` (the CUDA-core path up to ``DOT_MIN_ROWS - 1`` rows, tensor cores
from there), shapes that do and do not divide the blocks, several blocks along both axes, fp32
and bf16, a strided input and a row slice of a weight (the follower rows' ``W_Q``), the product
inside ``torch.compile``; natively on CUDA, in Triton's CPU interpreter without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.triton_interpret

SHAPES = [(300, 100), (256, 192), (64, 16), (520, 72)]  # (K, N): uneven and even, one to three blocks


@pytest.fixture(scope="module")
def skinny(kernel_device):
    from archlab.kernels import skinny_matmul

    return skinny_matmul


def draw(m, k, n, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)


def check(out, x, w, dtype):
    want = x.double() @ w.double().T
    # bf16 output: one ulp of each entry (the interpreter's conversion may truncate), fp32: the
    # accumulation order only
    rtol, atol = (2 ** -7, 1e-3 * want.abs().max().item()) if dtype == torch.bfloat16 else (0, 1e-4)
    assert out.dtype == x.dtype and out.shape == want.shape
    torch.testing.assert_close(out.cpu().double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_matches_float64(skinny, kernel_device, m, dtype):
    for i, (k, n) in enumerate(SHAPES):
        x, w = draw(m, k, n, seed=10 * m + i, dtype=dtype)
        check(skinny.skinny_matmul(x.to(kernel_device), w.to(kernel_device)), x, w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_gated_input_matches_float64(skinny, kernel_device, m, dtype):
    """``gated=True``: the product of ``silu(gate) * up`` (SwiGLU's ``[gate | up]``), formed as
    the kernel loads it, against float64 of the same gating rounded once to the input's dtype."""
    for i, (k, n) in enumerate(SHAPES):
        h, w = draw(m, 2 * k, n, seed=100 + 10 * m + i, dtype=dtype)
        w = w[:, :k].contiguous()
        g, up = h.double().chunk(2, dim=-1)
        gated = torch.nn.functional.silu(g) * up
        want = gated @ w.double().T
        out = skinny.skinny_matmul(h.to(kernel_device), w.to(kernel_device), gated=True)
        assert out.dtype == dtype and out.shape == want.shape
        # bf16: each gated entry is rounded once (one ulp, 2^-8, or 2^-7 where the interpreter
        # truncates), then the output once: bound each output by those roundings' worst sum
        ulp = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
        bound = ulp * (gated.abs() @ w.double().abs().T) + ulp * want.abs() + 1e-5
        assert ((out.cpu().double() - want).abs() <= bound).all()
        ref = skinny.skinny_matmul_reference(h, w, gated=True)
        assert ((ref.double() - want).abs() <= bound).all()


def test_gated_input_refuses_a_width_that_is_not_twice_the_weight(skinny, kernel_device):
    h, w = draw(1, 64, 8, seed=7, dtype=torch.float32)
    with pytest.raises(ValueError, match="gated"):
        skinny.skinny_matmul(h.to(kernel_device), w.to(kernel_device), gated=True)  # 64 != 2 x 64
    with pytest.raises(ValueError, match="gated"):
        skinny.skinny_matmul(h[:, :63].to(kernel_device), w[:, :31].contiguous().to(kernel_device), gated=True)


def test_leading_dimensions_strided_input_and_a_weight_row_slice(skinny, kernel_device):
    x, w = draw(6, 96, 80, seed=3, dtype=torch.float32)
    x3 = x.view(2, 3, 96).to(kernel_device)
    out = skinny.skinny_matmul(x3, w.to(kernel_device))
    assert out.shape == (2, 3, 80)
    check(out.reshape(6, 80), x, w, torch.float32)
    wide = torch.cat([x, x], dim=1).to(kernel_device)[:, ::2]  # a non-contiguous input
    check(skinny.skinny_matmul(wide, w.to(kernel_device)), wide.cpu(), w, torch.float32)
    rows = w.to(kernel_device)[:48]  # the first rows of a weight (a query projection of wqkv)
    check(skinny.skinny_matmul(x.to(kernel_device), rows), x, w[:48], torch.float32)


def test_bad_shapes_are_refused(skinny, kernel_device):
    x, w = draw(17, 32, 8, seed=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="rows"):
        skinny.skinny_matmul(x.to(kernel_device), w.to(kernel_device))
    with pytest.raises(ValueError, match="does not fit"):
        skinny.skinny_matmul(x[:2, :31].to(kernel_device), w.to(kernel_device))
    with pytest.raises(ValueError, match="does not fit"):
        skinny.skinny_matmul(x[:2].to(kernel_device), w.to(kernel_device).T.contiguous().T)


@pytest.mark.compile
def test_inside_torch_compile(skinny, kernel_device):
    """One opaque op in a compiled function, with the pointwise work around it fused."""
    x, w = draw(2, 128, 48, seed=5, dtype=torch.float32)
    x, w = x.to(kernel_device), w.to(kernel_device)

    def f(x, w):
        return torch.nn.functional.silu(skinny.skinny_matmul(x * 2, w)) + 1

    got = torch.compile(f, dynamic=False)(x, w)
    want = torch.nn.functional.silu(2 * x.double().cpu() @ w.double().cpu().T) + 1
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.compile
def test_a_compiled_graph_holds_the_custom_op(skinny, kernel_device):
    """Traced, the product is the opaque op (not the Triton launch, which eager calls directly)."""
    x, w = draw(2, 64, 32, seed=6, dtype=torch.float32)
    targets = []

    def record(gm, inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    torch.compile(lambda x, w: skinny.skinny_matmul(x, w) + 1, backend=record)(x.to(kernel_device), w.to(kernel_device))
    op = torch.ops.archlab.skinny_matmul
    assert op in targets or op.default in targets


@pytest.mark.compile
def test_the_gated_product_inside_torch_compile(skinny, kernel_device):
    """The gated form is the same opaque op under ``torch.compile`` (its flag an argument)."""
    h, w = draw(1, 96, 40, seed=8, dtype=torch.float32)
    w = w[:, :48].contiguous()
    h, w = h.to(kernel_device), w.to(kernel_device)
    got = torch.compile(lambda h, w: skinny.skinny_matmul(h, w, gated=True) * 3, dynamic=False)(h, w)
    want = 3 * skinny.skinny_matmul_reference(h.cpu(), w.cpu(), gated=True)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_an_eager_call_does_not_import_dynamo(tmp_path):
    """The first call of a ``torch.library.custom_op`` imports ``torch._dynamo`` (seconds at
    start-up); the eager product launches the kernel itself."""
    import os
    import subprocess
    import sys

    probe = ("import sys, torch\n"
             "from archlab.kernels.skinny_matmul import skinny_matmul, skinny_matmul_reference\n"
             "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
             "x, w = torch.randn(1, 64, device=dev), torch.randn(32, 64, device=dev)\n"
             "torch.testing.assert_close(skinny_matmul(x, w), skinny_matmul_reference(x, w), rtol=0, atol=1e-4)\n"
             "print('torch._dynamo' in sys.modules)\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == ["False"]
