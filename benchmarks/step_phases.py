"""Is the training step host-bound? Host launch time against completion time, per phase.

    PYTHONPATH=src python benchmarks/step_phases.py --data DIR [--preset 124m]
        [--variants baseline,attnres-triton] [--no-profile]

For each variant (names as in ``train_throughput.py``) it builds the trainer's run, warms up five
steps, then times five more in two phases, forward and backward, each from an idle GPU: how long
the host takes to issue the phase ("launch") and when the GPU has finished it ("done"). When
launch is close to done, the GPU waits for the host, and fewer or cheaper launches (or
``train.cuda_graph``) would help; when launch is far below done, the phase is GPU-bound. Then it
prints torch.profiler's top host-side operators for two steps. Medians of the five steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_throughput import VARIANTS  # noqa: E402

from archlab.config import make_config  # noqa: E402
from archlab.train.trainer import Run  # noqa: E402


def phases(run: Run, step: int) -> list[float]:
    """[forward launch, forward done, backward launch, backward done] in ms for one micro-batch."""
    tc = run.cfg.train
    x, y = run.data.train_batch(step, 0, tc.batch_size, tc.seq_len, run.cfg.data.seed)
    x, y = x.to(run.device), y.to(run.device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with run.autocast:
        loss = run.step_fn(x, y).loss
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    run.opt.zero_grad(set_to_none=True)
    return [(t1 - t0) * 1e3, (t2 - t0) * 1e3, (t3 - t2) * 1e3, (t4 - t2) * 1e3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="prepared data directory (vocab <= the preset's)")
    ap.add_argument("--preset", default="124m")
    ap.add_argument("--variants", default="baseline,attnres-triton")
    ap.add_argument("--no-profile", action="store_true", help="skip the host-operator table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("step_phases: no CUDA device; nothing to measure")
        return
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            ap.error(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
        cfg = make_config(args.preset, overrides=[f"data.path={args.data}", "train.device=cuda",
                                                  "train.compile=true", *VARIANTS[variant]])
        run = Run(cfg, out_dir=Path("/tmp/unused"))
        for s in range(5):
            run.train_step(s)
        rows = [phases(run, s) for s in range(5, 10)]
        med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
        print(f"{variant}: fwd launch {med[0]:.1f} ms, fwd done {med[1]:.1f} ms; "
              f"bwd launch {med[2]:.1f} ms, bwd done {med[3]:.1f} ms", flush=True)
        if not args.no_profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for s in range(10, 12):
                    phases(run, s)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                            max_name_column_width=70), flush=True)
        del run


if __name__ == "__main__":
    main()
