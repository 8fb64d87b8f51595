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
# 3. The graphed baseline, the baseline with the fused linear + cross-entropy readout (/fused), and
#    the routing variants (default: MHAR H=4, Block AttnRes, full AttnRes, MHAR H=8, Block MHAR,
#    delta-MHAR, all on the Triton routing and graphed), each against the graphed baseline of the
#    same process. The list is in priority order: a timeout cuts its tail.
# Each part gets what is left of SECONDS (default 570); the JSON rows land in $OUT.
set -uo pipefail
total=${1:-570}
variants=${2:-baseline/graph,baseline/fused,baseline/graph/fused,mhar4-triton/graph,block8-attnres-triton/graph,attnres-triton/graph,mhar8-triton/graph,block8-mhar4-triton/graph,delta-mhar4-triton/graph}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
data=/tmp/d/en-large-prepared
mkdir -p /tmp/d && { [ -d $data ] || tar -xJf .gpu/en-large.tar.xz -C /tmp/d; } || exit 4
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null || true
timeout 90 python3 benchmarks/anchor_train124.py .gpu/gpu_anchor.py | tee "$OUT/anchor.txt"
left=$((total * 3 / 10 - SECONDS)); [ $left -gt 30 ] || left=30
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
