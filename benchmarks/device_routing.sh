#!/usr/bin/env bash
# Issue 30's depth-routing rows at 124m on a lent GPU machine, in one device call:
#
#   bash benchmarks/device_routing.sh [SECONDS] [VARIANTS]   (carry .gpu: en-large and gpu_anchor.py)
#
# 1. The plain-PyTorch anchor's 124M training row (benchmarks/anchor_train124.py), so every ratio
#    below is within this call.
# 2. The 124m baseline, plain, profiled (its 45 longest kernels), in a process of its own whose
#    inductor cache is kept: the generated code of its forward and backward graphs lands in
#    $OUT/inductor/, so a profile's kernel name can be read as source after the call.
# 3. The graphed baseline and the routing variants, each against the graphed baseline of the same
#    process (default: MHAR H=4, full AttnRes and Block AttnRes, each with the accumulating and
#    then the deferred backward; the fused readout; Block MHAR, MHAR H=8 and delta-MHAR deferred;
#    all on the Triton routing and graphed). The list is in priority order: a timeout cuts its tail.
# Before the anchor, where pytest is installed: the deferred backward's tests, natively.
# Each part gets what is left of SECONDS (default 570); the JSON rows land in $OUT.
set -uo pipefail
total=${1:-570}
variants=${2:-baseline/graph,mhar4-triton/graph,mhar4-triton-deferred/graph,attnres-triton/graph,attnres-triton-deferred/graph,block8-attnres-triton/graph,block8-attnres-triton-deferred/graph,baseline/fused,block8-mhar4-triton-deferred/graph,mhar8-triton-deferred/graph,delta-mhar4-triton-deferred/graph}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
data=/tmp/d/en-large-prepared
mkdir -p /tmp/d && { [ -d $data ] || tar -xJf .gpu/en-large.tar.xz -C /tmp/d; } || exit 4
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null || true
# The deferred backward's kernels natively against the float64 reference, and in the model
# against the list path (where pytest is installed there).
if python3 -c 'import pytest' 2>/dev/null; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_routing.py \
        tests/model/variants/test_attnres.py -k 'deferred or triton_matches or gradients_equal' 2>&1 | tail -4
fi
timeout 90 python3 benchmarks/anchor_train124.py .gpu/gpu_anchor.py | tee "$OUT/anchor.txt"
# the profiled baseline's share is 30% of what the tests and the anchor left (the thirty-third
# session's natively-run tests took all of a share counted from the start, and it printed nothing)
left=$(((total - SECONDS) * 3 / 10)); [ $left -gt 60 ] || left=60
TORCHINDUCTOR_CACHE_DIR=/tmp/ic_base TORCHINDUCTOR_FX_GRAPH_CACHE=0 timeout $left \
    python3 benchmarks/train_throughput.py --data $data --presets 124m --variants baseline --steps 10 \
    --warmup 6 --profile baseline --top 45 --json "$OUT/train_base.json" | tee "$OUT/train_base.txt"
# The compiled graphs' output code (every kernel's source inline, and the call order).
mkdir -p "$OUT/inductor"
grep -rl --include='*.py' 'def call(' /tmp/ic_base 2>/dev/null | while read -r f; do
    cp "$f" "$OUT/inductor/$(basename "$f")"; done
left=$((total - SECONDS)); [ $left -gt 60 ] || exit 0
timeout $left python3 benchmarks/train_throughput.py --data $data --presets 124m --variants "$variants" \
    --steps 10 --warmup 6 --json "$OUT/train_routing.json" | tee "$OUT/train_routing.txt"
