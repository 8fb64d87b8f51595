#!/usr/bin/env bash
# Delta-MHAR on SmolLM2-135M (issue 27, item 5) on a lent GPU machine, over the calls of one lease.
#
#   here:   bash benchmarks/device_delta_mhar.sh pack GGUF DATA_DIR TASKS_TAR_XZ WHEEL_DIR
#   there:  bash benchmarks/device_delta_mhar.sh run SECONDS [delta_mhar_pretrained.py options...]
#
# Why in parts: the GGUF is 98.4 MB and a call carries 64 MiB with the repository, so `pack` cuts
# it into three pieces and writes three git-ignored folders, .smol1 (the wheels lm-eval and gguf
# need, the prepared data, piece 1), .smol2 (piece 2) and .smol3 (piece 3, the task data), each
# small enough for one call. Each `run` call carries one of them (in order) and copies what it
# finds into /tmp/smol, which stays while the machine is warm (calls follow within its idle time).
# Once every piece is there and the joined file matches the sha256 recorded by `pack`, `run`
# installs the wheels, imports the model, and runs benchmarks/delta_mhar_pretrained.py into
# runs/dmhar, watching it for SECONDS. Where commands run as an ordinary user (whose processes
# end with the call) it then gets SIGINT (a training run saves its checkpoint) and the next call
# resumes from runs/dmhar/results.json; as root it keeps running between calls. Results and logs come back in $OUT/dmhar.
set -uo pipefail
mode=${1:?pack or run}; shift
if [ "$mode" = pack ]; then
    gguf=${1:?gguf}; data=${2:?prepared data dir}; tasks=${3:?tasks.tar.xz}; wheels=${4:?wheel dir}
    rm -rf .smol1 .smol2 .smol3 && mkdir -p .smol1/wheels .smol2 .smol3 || exit 1
    grep -qs '^\.smol\*/$' .git/info/exclude || echo '.smol*/' >> .git/info/exclude
    size=$(stat -c %s "$gguf")
    first=24000000; rest=$(( (size - first + 1) / 2 ))
    head -c $first "$gguf" > .smol1/gguf.part1
    tail -c +$((first + 1)) "$gguf" | head -c $rest > .smol2/gguf.part2
    tail -c +$((first + rest + 1)) "$gguf" > .smol3/gguf.part3
    sha256sum < "$gguf" | cut -d' ' -f1 > .smol1/gguf.sha256
    cp "$wheels"/*.whl .smol1/wheels/ || exit 1
    tar --sort=name --owner=0 --group=0 --mtime=2026-12-01 --exclude=.archlab-verified.json \
        -C "$(dirname "$data")" -cf - "$(basename "$data")" | xz -6 -T2 > .smol1/data.tar.xz || exit 1
    basename "$data" > .smol1/data.name
    cp "$tasks" .smol3/tasks.tar.xz || exit 1
    du -sb .smol1 .smol2 .smol3
    exit 0
fi
seconds=${1:?seconds}; shift
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1
mkdir -p /tmp/smol "$OUT/dmhar"
# what an earlier call brought stays; only files not there yet are copied
for d in .smol1 .smol2 .smol3; do
    [ -d "$d" ] || continue
    (cd "$d" && find . -type f) | while read -r f; do
        [ -e "/tmp/smol/$f" ] || { mkdir -p "/tmp/smol/$(dirname "$f")" && cp "$d/$f" "/tmp/smol/$f"; }
    done
done
ls /tmp/smol
if [ ! -f /tmp/smol/model.gguf ]; then
    for i in 1 2 3; do [ -f /tmp/smol/gguf.part$i ] || { echo "gguf piece $i not here yet"; exit 0; }; done
    cat /tmp/smol/gguf.part1 /tmp/smol/gguf.part2 /tmp/smol/gguf.part3 > /tmp/smol/joined.gguf
    [ "$(sha256sum < /tmp/smol/joined.gguf | cut -d' ' -f1)" = "$(cat /tmp/smol/gguf.sha256)" ] \
        || { echo "joined gguf: sha256 mismatch"; exit 4; }
    mv /tmp/smol/joined.gguf /tmp/smol/model.gguf
fi
if [ ! -f /tmp/smol/ready ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        /tmp/smol/wheels/*.whl || exit 3
    python3 -c "import lm_eval, gguf, datasets; print('lm_eval', lm_eval.__version__)" || exit 3
    mkdir -p /tmp/smol/tasks && tar -xJf /tmp/smol/tasks.tar.xz -C /tmp/smol/tasks || exit 4
    tar -xJf /tmp/smol/data.tar.xz -C /tmp/smol || exit 4
    rm -rf runs/smol-ckpt; python3 -m archlab.cli import-hf --src /tmp/smol/model.gguf --out runs/smol-ckpt 2>&1 | tail -2
    [ -f runs/smol-ckpt/model.safetensors ] || exit 5
    touch /tmp/smol/ready
fi
[ "$(id -u)" = 0 ] || seconds=$((seconds - 45))
end=$((SECONDS + seconds))
running() { [ -s /tmp/dmhar.pid ] && kill -0 "$(cat /tmp/dmhar.pid)" 2>/dev/null; }
if ! running; then
    rm -f /tmp/dmhar.pid
    # its own session: SIGINT to the group reaches the training processes too
    setsid bash -c "echo \$\$ > /tmp/dmhar.pid; exec python3 benchmarks/delta_mhar_pretrained.py --ckpt runs/smol-ckpt \
        --data /tmp/smol/$(cat /tmp/smol/data.name) --task-dir /tmp/smol/tasks --out runs/dmhar --device cuda $* \
        >> /tmp/dmhar.log 2>&1" &
    for _ in $(seq 20); do [ -s /tmp/dmhar.pid ] && break; sleep 0.5; done
fi
copy_out() {
    cp /tmp/dmhar.log "$OUT/dmhar/" 2>/dev/null
    cp runs/dmhar/*.json runs/dmhar/*.log "$OUT/dmhar/" 2>/dev/null
}
while [ $SECONDS -lt $end ] && running; do copy_out; sleep 10; done
if [ "$(id -u)" != 0 ] && running; then
    kill -INT -- "-$(cat /tmp/dmhar.pid)"
    for _ in $(seq 40); do running || break; sleep 1; done
fi
copy_out
running && echo "still running" || echo "not running"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
grep -v "it/s\]" /tmp/dmhar.log | tail -40
