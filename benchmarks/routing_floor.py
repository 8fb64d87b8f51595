"""The traffic floor of exact depth routing: how fast AttnRes / MHAR can train at best, by arithmetic.

    python benchmarks/routing_floor.py [--presets 124m,350m,1b] [--blocks 0,8] [--bandwidth 3.0]
        [--base-ms 124m=72.6] [--removed-ms 124m=3.8] [--measured 124m:0=7.9/16.5]

Full or block routing reads, at every routing site, each of its sources' rows: the (read, source)
pairs are the model's own ``read_source_counts`` (the same function the model's cost accounting
uses), so the count cannot drift from the code. Every pair moves one bf16 row of width ``d`` once
in the forward and three times in the backward (the source again for its logit gradient, and
its gradient accumulator read and written back), per position of every micro-batch. At copy
bandwidth ``--bandwidth`` (TB/s, the card's measured copy rate; 2.96-3.01 on the H100 of the
twenty-ninth session, 4.1 on the H200) that is a floor on the routing's time. MHAR's heads split
each row, not the pairs, so the floor is the same for any ``H``.

With the baseline's step time (``--base-ms``) and the time of the residual adds that routing
replaces (``--removed-ms``, measured as the drop in the baseline's fused elementwise kernels), the
best ratio any exact kernel of this traffic can reach is ``base / (base + floor - removed)``.
With the routing kernels' measured time per step (``--measured PRESET:BLOCKS=FWD/BWD``, ms, from
``train_throughput.py --profile``'s "routing fwd" and "routing bwd" categories) it also prints the
bytes/s they reached on that traffic, against the copy bandwidth. Prints Markdown tables; nothing
is timed here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from archlab.config import make_config  # noqa: E402
from archlab.errors import ConfigError  # noqa: E402
from archlab.model.variants.attnres.module import attnres_blocks, read_source_counts  # noqa: E402

PASSES_FORWARD, PASSES_BACKWARD = 1, 3
BYTES = 2  # bf16 sources and gradient sums (the routing's defaults)


def per_preset(ap: argparse.ArgumentParser, text: str, what: str) -> dict[str, float]:
    """``PRESET=MS,...`` as a dict; anything else ends in one line and exit 2."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        try:
            out[key] = float(value) if sep else None
        except ValueError:
            out[key] = None
        if out[key] is None or out[key] < 0:
            ap.error(f"{what} takes PRESET=MS pairs with MS >= 0, got {item!r}")
    return out


def measured_ms(ap: argparse.ArgumentParser, text: str) -> dict[tuple[str, int], tuple[float, float]]:
    """``PRESET:BLOCKS=FWD/BWD,...`` as {(preset, blocks): (fwd ms, bwd ms)}; else one line, exit 2."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        preset, _, blocks = key.partition(":")
        fwd, _, bwd = value.partition("/")
        try:
            out[preset, int(blocks)] = (float(fwd), float(bwd))
        except ValueError:
            ap.error(f"--measured takes PRESET:BLOCKS=FWD/BWD (ms), got {item!r}")
        if min(out[preset, int(blocks)]) <= 0:
            ap.error(f"--measured times must be positive, got {item!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="124m,350m,1b")
    ap.add_argument("--blocks", default="0,8", help="routing blocks; 0 is full routing")
    ap.add_argument("--bandwidth", type=float, default=3.0, help="copy bandwidth in TB/s")
    ap.add_argument("--base-ms", default="", help="baseline step ms per preset: 124m=72.6,...")
    ap.add_argument("--removed-ms", default="", help="residual-add ms routing removes per preset")
    ap.add_argument("--measured", default="",
                    help="routing kernels' measured ms per step: PRESET:BLOCKS=FWD/BWD,... (e.g. 124m:0=7.9/16.5)")
    args = ap.parse_args()
    measured = measured_ms(ap, args.measured)
    reached = []
    if args.bandwidth <= 0:
        ap.error("--bandwidth must be positive")
    base, removed = per_preset(ap, args.base_ms, "--base-ms"), per_preset(ap, args.removed_ms, "--removed-ms")
    try:
        blocks_list = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        ap.error(f"--blocks takes integers (0 = full routing), got {args.blocks!r}")
    print(f"copy bandwidth {args.bandwidth} TB/s; {PASSES_FORWARD} pass forward, {PASSES_BACKWARD} backward, bf16")
    print("| preset | routing | (read, source) pairs | positions / step | d | forward ms | backward ms "
          "| floor ms | baseline ms | best ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        for blocks in blocks_list:
            try:
                cfg = make_config(preset, overrides=["model.residual.kind=attnres", f"model.residual.blocks={blocks}"])
            except ConfigError as e:
                ap.error(str(e))
            n_blocks = attnres_blocks(cfg.model)
            n_sites = len(read_source_counts(cfg.model, n_blocks)) - 1  # the last read is the final one
            pairs = sum(read_source_counts(cfg.model, n_blocks))
            positions = cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum
            d = cfg.model.d_model
            pass_ms = pairs * positions * d * BYTES / (args.bandwidth * 1e12) * 1e3
            fwd, bwd = PASSES_FORWARD * pass_ms, PASSES_BACKWARD * pass_ms
            floor = fwd + bwd
            label = "full" if n_blocks == n_sites else f"block {n_blocks}"
            if preset in base:
                b = base[preset]
                best = f"{b / (b + floor - removed.get(preset, 0.0)):.3f}x"
                b_text = f"{b:.1f}"
            else:
                best = b_text = "-"
            print(f"| {preset} | {label} | {pairs} | {positions:,} | {d} | {fwd:.1f} | {bwd:.1f} | {floor:.1f} "
                  f"| {b_text} | {best} |")
            if (preset, blocks) in measured:
                m_fwd, m_bwd = measured[preset, blocks]
                gb = pass_ms * args.bandwidth * 1e12 / 1e3 / 1e9  # one pass's bytes, GB
                reached.append((preset, label, m_fwd, PASSES_FORWARD * gb, m_bwd, PASSES_BACKWARD * gb))
    if reached:
        print(f"\nmeasured routing kernels on this traffic (copy bandwidth {args.bandwidth} TB/s)")
        print("| preset | routing | forward ms | forward GB | forward TB/s | of copy | backward ms | backward GB "
              "| backward TB/s | of copy |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for preset, label, m_fwd, gb_fwd, m_bwd, gb_bwd in reached:
            tf, tb = gb_fwd / m_fwd, gb_bwd / m_bwd  # GB/ms = TB/s
            print(f"| {preset} | {label} | {m_fwd:.1f} | {gb_fwd:.1f} | {tf:.2f} | {tf / args.bandwidth:.0%} "
                  f"| {m_bwd:.1f} | {gb_bwd:.1f} | {tb:.2f} | {tb / args.bandwidth:.0%} |")


if __name__ == "__main__":
    main()
