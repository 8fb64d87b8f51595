#!/usr/bin/env bash
# Issue 30's training table at one preset on a lent GPU machine, in one device call:
#
#   bash benchmarks/device_train_table.sh PRESET [SECONDS] [VARIANTS]   (carry .gpu: en-large, gpu_anchor.py)
#
# 1. The plain-PyTorch anchor's training row at the matching size (124M for 124m, 350M for 350m;
#    gpu_anchor.py trains no 1B model, so a 1b table has ratios to its own baseline only).
# 2. Where .gpu/before_src.tar.gz exists (`git archive COMMIT src | gzip`), that commit's graphed
#    baseline in a process of its own, before and after this code's rows: an A/B/A on one card,
#    so a change's effect is not mistaken for the card's drift within the call.
# 3. This code's variants, each against the graphed baseline of the same process, in the
#    order given (a timeout cuts the tail). Default: the depth-routing family and the decode
#    branch, all graphed, Triton routing.
# PROFILE=VARIANT also profiles that variant's step (kernel categories and its longest kernels).
# Each part gets what is left of SECONDS (default 570); the JSON rows land in $OUT.
set -uo pipefail
preset=${1:?usage: device_train_table.sh PRESET [SECONDS] [VARIANTS]}
total=${2:-570}
variants=${3:-baseline/graph,attnres-triton/graph,block8-attnres-triton/graph,mhar4-triton/graph,mhar8-triton/graph,block8-mhar4-triton/graph,delta-mhar4-triton/graph,decode-branch/graph}
case $preset in
    124m) steps="--steps 10 --warmup 6"; anchor=124M ;;
    350m) steps="--steps 8 --warmup 6"; anchor=350M ;;
    1b) steps="--steps 4 --warmup 5"; anchor= ;;
    *) echo "device_train_table: unknown preset '$preset' (124m, 350m or 1b)" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
data=/tmp/d/en-large-prepared
mkdir -p /tmp/d && { [ -d $data ] || tar -xJf .gpu/en-large.tar.xz -C /tmp/d; } || exit 4
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null || true
[ -z "$anchor" ] || timeout 100 python3 benchmarks/anchor_train124.py .gpu/gpu_anchor.py $anchor | tee "$out/anchor.txt"
before() {  # the earlier commit's graphed baseline, its own process and inductor cache
    [ -f .gpu/before_src.tar.gz ] || return 0
    mkdir -p /tmp/before && tar -xzf .gpu/before_src.tar.gz -C /tmp/before || return 0
    PYTHONPATH=/tmp/before/src TORCHINDUCTOR_CACHE_DIR=/tmp/ic_before timeout "$1" python3 \
        benchmarks/train_throughput.py --data $data --presets $preset --variants baseline/graph $steps \
        --json "$out/before_$2.json" | grep '^| '
}
before 120 a
left=$((total - SECONDS - 70)); [ $left -gt 60 ] || left=60
PYTHONPATH=$PWD/src timeout $left python3 benchmarks/train_throughput.py --data $data --presets $preset \
    --variants "$variants" $steps ${PROFILE:+--profile "$PROFILE" --top 12} --json "$out/train_$preset.json" \
    | tee "$out/train_$preset.txt"
left=$((total - SECONDS)); [ $left -gt 30 ] && before $left b
exit 0
