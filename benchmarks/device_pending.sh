#!/usr/bin/env bash
# What the thirty-fourth session built and could not measure (no device machine was lent), as
# one device call of about 590 s, in priority order (a timeout cuts the tail):
#
#   git archive 584d5a8 src | gzip > .gpu/before_src.tar.gz    # once, on this machine
#   bash benchmarks/device_pending.sh                           # on the device (carry .gpu)
#
# 1. Issue 30, item 3: the anchor's 124M row, then 584d5a8's graphed baseline (RoPE laid out
#    [B, H, T, hd]), this code's (RoPE computed [B, T, H, hd]) and MHAR H=4 with a profile of its
#    step (the routing kernels' ms, for their bytes/s against benchmarks/routing_floor.py's
#    traffic), then 584d5a8's baseline again: an A/B/A on one card.
# 2. Issue 28, item 5: the gated decode kernel natively against its reference, then batch-1
#    decode of the baseline with SwiGLU's gating inside w_down's kernel and without, at 124m
#    (w_down on the skinny kernel by the measured rule) and at 1b (the rule as measured, then
#    widened to put 1b's 2048-wide wo and w_down on the kernel, where the gating then fuses).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
PROFILE=mhar4-triton/graph bash benchmarks/device_train_table.sh 124m 280 baseline/graph,mhar4-triton/graph \
    2>&1 | grep -v '^{"preset"'
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
timeout 30 python3 benchmarks/check_gated_gemv.py
decode() {  # one preset's baseline decode rows, the table and any error
    timeout "$1" python3 benchmarks/decode_latency.py --presets "$2" --batches 1 --no-prefill --no-branch \
        "${@:3}" --json "$out/decode_$2.json" 2>&1 | grep -E '^\||copy_TBps|Error|error|"kind"'
}
decode 140 124m --swiglu unfused,fused
decode 140 1b --swiglu fused --auto-max-out 1024,2048
ls "$out"
