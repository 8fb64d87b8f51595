#!/usr/bin/env bash
# The server's figures on a lent GPU machine, in one device call (docs/benchmarks.md):
#
#   bash benchmarks/device_serve.sh TOKENIZER_JSON
#
# 1. The host path alone on this machine's CPU: the null model against a simulated device with
#    the GPU's timings (a 0.737 ms decode step at 64 slots, 1.5 ms per prefill call), padded and
#    unpadded prefill groups in turn (--compare-pad), the load from one client process and from
#    four. Set beside the same run on another machine, it says whether the host or the GPU sets
#    the rate.
# 2. The real server on the GPU (124m, random weights, bf16), 64 streaming clients from four
#    other processes, with the engine's own rate at 64 slots measured in the same process first:
#    six loads, padded and unpadded in turn, each with where its time went (serve_load's
#    timeline); then two loads from one client process.
# 3. Two more loads under py-spy (non-blocking, 250 Hz), its raw stacks in $OUT/serve.raw.
# FastAPI and uvicorn (and py-spy) come from wheels carried in .gpu/wheels when the image lacks them.
set -uo pipefail
tok=${1:?tokenizer.json}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
for mod in fastapi uvicorn httpx; do
    python3 -c "import $mod" 2>/dev/null || python3 -m pip install -q --no-index --find-links .gpu/wheels "$mod" || exit 3
done
command -v py-spy >/dev/null || python3 -m pip install -q --no-index --find-links .gpu/wheels py-spy
lscpu | grep -m1 "Model name"
# the simulated device: one client process, then four (does the load generator keep up?)
for procs in 1 4; do
    timeout 90 python3 benchmarks/serve_load.py --device cpu --preset tiny --tokenizer "$tok" --clients 64 \
        --max-tokens 256 --null-model --device-step-ms 0.737 --device-prefill-ms 1.5 --repeats 2 --compare-pad \
        --client-procs $procs --json "$OUT/simulated-$procs.json" | grep aggregate
done
# the real server: four client processes, padded and unpadded in turn, then one client process
timeout 240 python3 benchmarks/serve_load.py --tokenizer "$tok" --preset 124m --clients 64 --max-tokens 256 \
    --repeats 3 --compare-pad --client-procs 4 --json "$OUT/serve-4.json" | grep -v '^{"clients": 1,'
timeout 120 python3 benchmarks/serve_load.py --tokenizer "$tok" --preset 124m --clients 64 --max-tokens 256 \
    --repeats 2 --client-procs 1 --json "$OUT/serve-1.json" | grep aggregate
if command -v py-spy >/dev/null; then
    timeout 120 py-spy record --nonblocking --threads -r 250 -f raw -o "$OUT/serve.raw" -- \
        python3 benchmarks/serve_load.py --tokenizer "$tok" --preset 124m --clients 64 --max-tokens 256 \
        --repeats 2 --client-procs 4 | grep aggregate
fi
