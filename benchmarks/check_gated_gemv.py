"""The gated skinny-matmul kernel natively on a GPU against its fp32 reference, at the decode
shapes it serves (``w_down`` of 124m and 1b, one and two rows): the maximum error per shape.

    PYTHONPATH=src python3 benchmarks/check_gated_gemv.py

CI checks the kernel in Triton's CPU interpreter (tests/kernels/test_skinny_matmul.py); this is
the same comparison compiled for the card, as the brief asks of every Triton kernel.
"""

import torch

from archlab.kernels.skinny_matmul import skinny_matmul, skinny_matmul_reference


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("check_gated_gemv: no CUDA device; nothing to check")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| rows | K (hidden) | N (out) | max abs error | max abs output | within 1% of it |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for m, k, n in ((1, 2048, 768), (2, 2048, 768), (1, 5504, 2048), (2, 5504, 2048)):
        h = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
        got = skinny_matmul(h, w, gated=True).float()
        want = skinny_matmul_reference(h, w, gated=True).float()
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        worst = max(worst, err / scale)
        print(f"| {m} | {k} | {n} | {err:.3g} | {scale:.3g} | {'yes' if err <= 0.01 * scale else 'NO'} |")
    if worst > 0.01:
        raise SystemExit(f"check_gated_gemv: error {worst:.3g} of the output's scale")


if __name__ == "__main__":
    main()
