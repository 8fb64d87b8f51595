#!/usr/bin/env bash
# Issue 30's training-speed figures at 124m on a lent GPU machine, in one device call:
#
#   bash benchmarks/device_speed.sh [SECONDS]      (carry .gpu: en-large and gpu_anchor.py)
#
# 1. The plain-PyTorch anchor's 124M training row (benchmarks/anchor_train124.py, running the
#    shared gpu_anchor.py copied to .gpu/), so every ratio below is within this call.
# 2. The 124m baseline's step: plain, with inductor's coordinate-descent tuning (/cd), as one
#    CUDA graph (/graph) and both, with a profile of the plain step's 45 longest kernels (where
#    the step's elementwise time goes: 20 of 67 ms in the fourth session's profile).
# 3. Batch-1 decode at 124m and 1b, without and with coordinate descent (issue 28, item 5).
# Each part gets what is left of SECONDS (default 570); the JSON rows land in $OUT.
set -uo pipefail
total=${1:-570}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
data=/tmp/d/en-large-prepared
mkdir -p /tmp/d && { [ -d $data ] || tar -xJf .gpu/en-large.tar.xz -C /tmp/d; } || exit 4
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 benchmarks/anchor_train124.py .gpu/gpu_anchor.py | tee "$OUT/anchor.txt"
left=$((total * 7 / 10 - SECONDS))
timeout $left python3 benchmarks/train_throughput.py --data $data --presets 124m \
    --variants baseline,baseline/cd,baseline/graph,baseline/graph/cd --steps 10 --warmup 6 \
    --profile baseline --top 45 --json "$OUT/train.json" | tee "$OUT/train.txt"
for cd in "" --coordinate-descent; do
    left=$((total - SECONDS)); [ $left -gt 60 ] || break
    timeout $left python3 benchmarks/decode_latency.py --presets 124m,1b --batches 1 --no-prefill $cd \
        | tee -a "$OUT/decode.txt"
done
