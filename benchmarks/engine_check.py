"""The engine on a GPU against the full forward: compiled prefill, CUDA-graph decode, per option.

    python benchmarks/engine_check.py

For each model option (fp32, TF32 off, small dims): teacher-forced engine predictions equal the full
uncached forward at every step (``assert_matches_full_forward``, atol 1e-4; greedy generation
and continuous batching are checked by the CPU tests, on the same code). MoE runs in bf16 (its grouped expert
matmul needs it to be capturable) and is compared with a looser tolerance. Prints one line per
option and exits non-zero if any fails. The CPU test suite runs the same checks without graphs.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from archlab.config import make_config  # noqa: E402
from archlab.model import build_model  # noqa: E402
from tests.infer.test_generate import assert_matches_full_forward  # noqa: E402

BASE = ["model.vocab_size=512", "model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
        "model.max_seq_len=128"]
OPTIONS = {
    "baseline": [],
    "branch": ["model.branch.enabled=true", "model.branch.n_branches=2"],
    "mhar4-triton+branch": ["model.residual.kind=attnres", "model.residual.heads=4", "model.residual.impl=triton",
                            "model.branch.enabled=true"],
}


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failed = 0
    from archlab.kernels import decode_attention

    default_split = decode_attention.MIN_SPLIT
    # Each option twice: with the decode kernel's default splits (one split of this small cache),
    # and with splits of 16 slots, merged inside the kernel by the split counters.
    runs = [(f"{name}{suffix}", over, split) for name, over in OPTIONS.items()
            for suffix, split in (("", default_split), (" (8 splits)", 16))]
    for name, over, split in runs:
        decode_attention.MIN_SPLIT = split
        t = time.perf_counter()
        try:
            torch.manual_seed(0)
            model = build_model(make_config("tiny", overrides=[*BASE, *over]).model).cuda().eval()
            for n, p in model.named_parameters():
                if ".couple_" in n or "queries" in n:
                    torch.nn.init.normal_(p, 0.0, 0.3)
            bf16 = "bf16" in name
            if bf16:
                model = model.to(torch.bfloat16)
            g = torch.Generator().manual_seed(1)
            seqs = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (40, 23, 31)]
            assert_matches_full_forward(model, seqs, prompt_lens=[17, 5, 30], atol=0.15 if bf16 else 1e-4)
            print(f"ok    {name} ({time.perf_counter() - t:.1f} s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL  {name}\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
