"""``archlab compare``, ``archlab merge`` and ``archlab report``.

``compare`` checks the whole suite (every run's config, the budget) before it trains anything,
then trains what is missing and writes the report. A bad suite file or variant key is a
``ConfigError``: the main CLI prints it as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from archlab.argtypes import positive_int
from archlab.errors import ConfigError, UsageError
from archlab.lab.suite import builtin_suites

if TYPE_CHECKING:
    from rich.console import Console

    from archlab.lab.gpus import GpuPlan
    from archlab.lab.latency import MeasureFn
    from archlab.lab.plan import CostsFn, PlannedRun
    from archlab.lab.runner import PrepareFn, TrainFn

# The main CLI imports this module for every command, so the lab's heavy imports (scipy,
# matplotlib, the trainer) happen inside the commands that need them.


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``compare``, ``merge`` and ``report`` to the main parser."""
    c = subparsers.add_parser(
        "compare", help="train a suite of variants under a matched budget and test them",
        description="Run a comparison suite: the baseline with several seeds and every variant "
                    "under the same token (or FLOP) budget, then report differences against the "
                    "baseline's noise floor with Bonferroni-corrected significance. Finished runs "
                    "are skipped and interrupted runs continue from their checkpoints.")
    c.add_argument("suite", nargs="?", default="default",
                   help=f"a built-in suite ({', '.join(builtin_suites())}) or a suite YAML file "
                        "(default: default)")
    c.add_argument("--out", type=Path, help="suite directory (default: runs/<suite name>)")
    c.add_argument("--dry-run", action="store_true",
                   help="print the plan (runs, tokens, costs, estimated time) and train nothing")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override a key of every run's config, e.g. --set train.device=cpu (repeatable)")
    c.add_argument("--variants", metavar="A,B",
                   help="train only these variants now (and the baseline); the report covers the suite")
    c.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                   help="train N runs at once, each in its own process (small models leave a GPU "
                        "mostly idle; default: 1); a run that runs out of GPU memory beside the "
                        "others lowers N by one and resumes from its checkpoint")
    c.add_argument("--gpus", metavar="IDS",
                   help="place the runs on these GPUs: 'all' (every visible CUDA device) or indices like "
                        "0,1; each run trains in its own process pinned to its GPU(s) "
                        "(CUDA_VISIBLE_DEVICES); replaces --jobs")
    c.add_argument("--runs-per-gpu", type=positive_int, default=None, metavar="K",
                   help="with --gpus: train up to K runs side by side on each GPU (default 1); raise it "
                        "while K runs fit in GPU memory and the suite's total tokens/s still grows")
    c.add_argument("--gpus-per-run", type=positive_int, default=None, metavar="N",
                   help="with --gpus: give each run N GPUs and train it under torchrun (needs "
                        "train.parallel ddp or fsdp; default 1)")
    c.add_argument("--no-resume", action="store_true",
                   help="start over: move the suite directory's results and runs aside (needs --force "
                        "when there are any)")
    c.add_argument("--force", action="store_true", help="confirm --no-resume")
    c.add_argument("--max-runs", type=positive_int, metavar="N",
                   help="start at most N runs in this call; the rest are left for the next (exit 0)")
    c.add_argument("--time-budget", type=positive_int, metavar="SECONDS",
                   help="start a run only if it is expected to finish within SECONDS of this call's "
                        "start (training time at the measured or estimated tokens/s; exit 0)")
    c.add_argument("--shard", metavar="I/N",
                   help="train only share I (0 to N-1) of the suite's runs, e.g. one of N machines, "
                        "each with its own --out; bring the directories together with archlab merge")
    c.add_argument("--amend-seeds", action="store_true",
                   help="run a suite whose seeds changed after results anyway; its report then draws "
                        "no verdicts (seeds are fixed before the runs)")
    c.set_defaults(func=run_compare)

    m = subparsers.add_parser(
        "merge", help="bring the finished runs of other directories of a suite into one",
        description="Import every run finished (or diverged) in OTHER and not in DIR: its results "
                    "database rows and its run directory. For a suite split across machines "
                    "(compare --shard I/N, one directory each) or run on a remote machine. OTHER "
                    "is never modified; another suite or config is refused. Exit 1 when a run "
                    "finished in both with different results (this directory's is kept).")
    m.add_argument("dir", type=Path, help="suite directory to merge into (holds results.sqlite)")
    m.add_argument("others", type=Path, nargs="+", metavar="OTHER", help="suite directories to merge from")
    m.set_defaults(func=run_merge)

    r = subparsers.add_parser("report", help="write report.md and report.html for a suite directory",
                              description="Build the report of a suite from its results database.")
    r.add_argument("dir", type=Path, help="suite directory (holds results.sqlite)")
    r.set_defaults(func=run_report)

    t = subparsers.add_parser(
        "trend", help="how each variant's effect moves between model sizes (suites) or training lengths "
                      "(a suite's budgets)",
        description="For every variant label the points share: its effect on the final validation loss "
                    "against each point's own baseline, with that point's adjusted p and verdict, the "
                    "change from the first point to the last, tested by Welch's t-test on the per-seed "
                    "differences (Holm over the labels), and whether the effect holds, shrinks, grows or "
                    "reverses. A point is a suite directory, or each token budget of a suite with several "
                    "(shortest first). Give the directories smallest model first.")
    t.add_argument("dirs", type=Path, nargs="+", metavar="DIR", help="finished suite directories (hold results.sqlite)")
    t.add_argument("--md", action="store_true", help="print a Markdown table instead of the terminal table")
    t.set_defaults(func=run_trend)


class Terminated(KeyboardInterrupt):
    """SIGTERM to ``compare``, raised where Ctrl-C raises KeyboardInterrupt (``sigterm_interrupts``)."""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """For the block, SIGTERM stops this process the way Ctrl-C does: an exception in the main
    thread, so that everything unwinds (the ``--jobs`` workers stopped, claims released, the
    database closed). Killed in the signal instead, the process would leave multiprocessing's
    semaphores to its resource tracker, which then warns of "leaked semaphore objects". What is
    kept is what Ctrl-C keeps: finished runs are recorded, the others resume from their
    checkpoints. Outside the main thread (no signal can be handled there) the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:  # noqa: ARG001
        raise Terminated(f"stopped by signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _start_over(out: Path, force: bool, console: Console) -> None:
    """``--no-resume``: move results and run directories to ``archive/<time>/`` (never delete:
    finished measurements are the expensive part)."""
    from archlab.lab.display import RUNS_DIR
    from archlab.lab.store import DB_NAME

    present = [p for p in (out / DB_NAME, out / RUNS_DIR) if p.exists()]
    if not present:
        return
    if not force:
        raise ConfigError(f"--no-resume would set aside the results in {out}; add --force to confirm")
    dest = out / "archive" / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True)
    for p in present:
        shutil.move(str(p), dest / p.name)
        for side in (p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm")):
            if side.exists():
                shutil.move(str(side), dest / side.name)
    console.print(f"previous results moved to {dest}")


def gpu_plan(args: argparse.Namespace, runs: list[PlannedRun], gpu_count: int | None = None) -> GpuPlan | None:
    """``--gpus``/``--runs-per-gpu``/``--gpus-per-run`` as a ``GpuPlan`` (None without ``--gpus``),
    checked against the CUDA devices this process sees (``gpu_count``: how many; by default
    torch is asked) and against the runs' ``train.device``."""
    from archlab.lab.gpus import GpuPlan, parse_gpus, visible_gpu_count

    spec = getattr(args, "gpus", None)
    per_gpu, per_run = getattr(args, "runs_per_gpu", None), getattr(args, "gpus_per_run", None)
    if spec is None:
        if per_gpu is not None or per_run is not None:
            raise ConfigError("--runs-per-gpu and --gpus-per-run need --gpus")
        return None
    if getattr(args, "jobs", 1) > 1:
        raise ConfigError("--jobs and --gpus do not combine: with --gpus, --runs-per-gpu sets how many runs "
                          "share a GPU")
    pinned = sorted({r.config.train.device for r in runs if r.config.train.device.startswith("cuda:")})
    if pinned:
        raise ConfigError(f"--gpus places every run on its own GPU(s), but train.device is {pinned[0]}; "
                          "set train.device to cuda or auto")
    count = visible_gpu_count() if gpu_count is None else gpu_count
    plan = GpuPlan(parse_gpus(spec, count), per_gpu or 1, per_run or 1)
    if plan.gpus_per_run > 1:
        # torchrun starts N copies of archlab train; only a data/model-parallel run makes them
        # one run (without it, N copies would train the same run into one directory).
        modes = sorted({str(getattr(r.config.train, "parallel", None)) for r in runs})
        if not set(modes) <= {"ddp", "fsdp"}:
            raise ConfigError(f"--gpus-per-run {plan.gpus_per_run} trains each run under torchrun, which needs "
                              f"train.parallel ddp or fsdp in every run (got {', '.join(modes)}); "
                              "e.g. --set train.parallel=ddp")
    return plan


def run_compare(args: argparse.Namespace, *, train_fn: TrainFn | None = None,
                costs_fn: CostsFn | None = None, prepare_fn: PrepareFn | None = None,
                console: Console | None = None, measure_fn: MeasureFn | None = None,
                gpu_count: int | None = None) -> int:
    """The ``compare`` command; the keyword arguments replace the trainer, the cost model, data
    preparation, the latency measurement and the number of visible CUDA devices (tests use them)."""
    from rich.console import Console

    from archlab.lab.fmt import plural
    from archlab.lab.plan import adopt_recorded_ids, build_plan, parse_shard, select, shard_ids
    from archlab.lab.display import plan_table
    from archlab.lab.store import DB_NAME, ResultStore
    from archlab.lab.session import Session
    from archlab.lab.suite import load_suite

    from archlab.lab.store.owner import lease_s

    console = console or Console()
    session = Session(max_runs=getattr(args, "max_runs", None), seconds=getattr(args, "time_budget", None),
                      amend_seeds=getattr(args, "amend_seeds", False))
    shard = getattr(args, "shard", None)
    share = None if shard is None else parse_shard(shard)  # a bad --shard stops before the plan is built
    lease_s()  # a bad ARCHLAB_CLAIM_* setting stops here, not at the first claim after training
    suite = load_suite(args.suite)
    out = Path(args.out) if args.out else Path("runs") / suite.name
    plan = build_plan(suite, out, args.overrides, costs_fn=costs_fn)
    if (plan.out_dir / DB_NAME).is_file() and not args.no_resume:
        # finished runs recorded by an older archlab are found again under their ids
        with ResultStore(plan.out_dir / DB_NAME, create=False) as store:
            plan = adopt_recorded_ids(plan, store.runs())
    chosen = None if not args.variants else [v.strip() for v in args.variants.split(",") if v.strip()]
    runs = select(plan, chosen)
    others = 0  # runs of the selection that belong to other shards: pending here, not errors
    if share is not None:
        mine = shard_ids(plan, *share)
        others = sum(r.run_id not in mine for r in runs)
        runs = [r for r in runs if r.run_id in mine]
        console.print(f"shard {shard}: {plural(len(runs), 'run')} of this suite's selection here, "
                      f"{others} in other shards", highlight=False)
    gpus = gpu_plan(args, runs, gpu_count)
    if gpus is not None:
        console.print(f"placing runs on GPU {','.join(map(str, gpus.gpus))}: {gpus.runs_per_gpu} per GPU, "
                      f"{gpus.gpus_per_run} per run, up to {gpus.concurrency} at once", highlight=False)
    if args.dry_run:
        rows, live = {}, {}
        if (plan.out_dir / DB_NAME).is_file() and not args.no_resume:
            with ResultStore(plan.out_dir / DB_NAME, create=False) as store:
                rows = {r.run_id: r for r in store.runs()}
                live = store.live_claims()
        table, summary = plan_table(plan, runs, rows, live)
        console.print(table)
        console.print(summary, highlight=False)
        for job in plan.data_jobs:
            if not job.path.exists():
                console.print(f"will prepare {job.describe()} (vocab {job.vocab_size}) into {job.path}")
        return 0
    # the report (scipy, matplotlib) and the runner take a second to import: only once the suite,
    # its plan and the arguments are known to be good, so that their errors come at once
    from archlab.lab.store.owner import network_filesystem
    from archlab.lab.report import print_report, write_report
    from archlab.lab.runner import run_suite, suite_lock

    fs = network_filesystem(plan.out_dir)
    if fs is not None:  # a warning, not an error: one host alone on a network share is fine
        console.print(f"[yellow]warning[/yellow]: {plan.out_dir} is on {fs}: {DB_NAME} (SQLite in WAL mode) "
                      "is not safe to share between machines there; run every compare of this suite "
                      "on one host", highlight=False)
    # Shared: other compares may work on this suite directory too (run claims keep them apart);
    # --no-resume moves results aside, so it runs alone.
    with sigterm_interrupts(), suite_lock(plan.out_dir, exclusive=args.no_resume):
        if args.no_resume:
            _start_over(plan.out_dir, args.force, console)
        with ResultStore(plan.out_dir / DB_NAME) as store:
            outcome = run_suite(plan, store, runs, train_fn=train_fn, prepare_fn=prepare_fn, console=console,
                                jobs=getattr(args, "jobs", 1), measure_fn=measure_fn, session=session,
                                gpus=gpus)
        md, html = write_report(plan.out_dir)
    print_report(plan.out_dir, console)
    busy = len(outcome.busy)
    console.print(f"{plural(outcome.finished, 'run')} trained, {outcome.skipped} already done"
                  + (f", {outcome.diverged} diverged" if outcome.diverged else "")
                  + (f", latency of {plural(outcome.measured, 'variant')} measured" if outcome.measured else "")
                  + (f", {busy} left to the other {'process' if busy == 1 else 'processes'} "
                     f"training {'it' if busy == 1 else 'them'}" if busy else "")
                  + (f", {plural(others, 'run')} left to the other shards" if shard is not None else "")
                  + f"; report: {md} and {html}", highlight=False)
    if session.summary():
        console.print(session.summary(), highlight=False)
    return 0


def run_merge(args: argparse.Namespace, *, console: Console | None = None) -> int:
    """The ``merge`` command (``archlab.lab.merge``); then the report of the merged directory."""
    from rich.console import Console

    from archlab.lab.merge import describe, merge_dirs
    from archlab.lab.report import write_report

    console = console or Console()
    outcome = merge_dirs(Path(args.dir), [Path(o) for o in args.others])
    for note in outcome.notes:
        console.print(note, highlight=False)
    md, html = write_report(Path(args.dir))
    console.print(f"{describe(outcome)}; report: {md} and {html}", highlight=False)
    return 1 if outcome.conflicts else 0


def run_report(args: argparse.Namespace) -> int:
    """The ``report`` command."""
    from rich.console import Console

    from archlab.lab.report import print_report, write_report

    console = Console()
    md, html = write_report(args.dir)
    print_report(args.dir, console)
    console.print(f"wrote {md} and {html}", highlight=False)
    return 0


def run_trend(args: argparse.Namespace) -> int:
    """The ``trend`` command: across suite directories, and across the budgets of each."""
    from rich.console import Console

    from archlab.lab.report.trend import check_distinct, load_suite_dir, markdown, trend, trend_table

    check_distinct(args.dirs)
    points = [p for d in args.dirs for p in load_suite_dir(d)]
    if len(points) < 2:
        raise UsageError("trend needs at least two points: two suite directories (smallest model first), "
                         "or one suite with several token budgets (budget.tokens: [...])")
    rows = trend(points)
    if args.md:
        print(markdown(rows))
        return 0
    Console().print(trend_table(rows))
    return 0
