"""The report's prose: the overview facts at its top (suite, budget, seeds, noise floor,
progress, verdict rule, minimum detectable effect, compute, devices, latency, downstream) and the
notes under its tables (how the method, costs, measured latency, downstream, held-out and compute
columns were obtained and should be read).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace

from archlab.lab.fmt import device_text, duration, latency_device_text, plural
from archlab.lab.report.data import ReportData
from archlab.lab.report.tables import compute_hours, paired_design
from archlab.lab.stats import POWER, mde_unpaired
from archlab.lab.stoprule import INVALID
from archlab.lab.store import FINAL_WEIGHTS, RunRow


def latency_fact(data: ReportData) -> str:
    """The overview line on measured latency: where it was timed, or why there is none."""
    m = data.measure
    if not data.measured:
        why = {"never": "costs.measure is never",
               "auto": "costs.measure auto measures runs trained on CUDA; always also times CPU runs"}
        return f"Measured latency: none ({why.get(m['measure'], 'no finished run measured yet')})"
    rows = [r for s in data.summaries for r in s.latency.values()]
    where = sorted({latency_device_text(r) for r in rows})
    sessions = len({r.session for r in rows})
    return (f"Measured latency: {'; '.join(where)}; final checkpoint of one run per variant, "
            f"{plural(sessions, 'measuring session')}")


def latency_note(data: ReportData) -> str:
    """How the measured columns were taken, and every shape measured smaller than asked."""
    m = data.measure
    ctx = data.plan["runs"][0]["cost_context"]
    rows = [r for s in data.summaries for r in s.latency.values()]
    cuda = any(r.timer == "cuda-events" for r in rows)
    text = (f"Measured latency: the inference engine of archlab serve (archlab.infer.bench) on the final "
            f"checkpoint of one run per variant (its first finished seed: latency does not depend on the seed), "
            f"timed after training in the suite's own process, one variant after another while no other archlab "
            f"run trained on the host. Prefill ms: a {m['prompt']}-token prompt at batch 1 until its first "
            f"token is chosen. Decode ms/token bN: one decode step of N sequences (one new token each) with "
            f"{ctx} tokens in the cache. Medians "
            + ("of CUDA-event timings after warm-up" if cuda else "")
            + (" and " if cuda and not all(r.timer == "cuda-events" for r in rows) else "")
            + ("of CPU wall-clock timings after warm-up (not comparable with GPU figures)"
               if any(r.timer == "wall-clock" for r in rows) else "")
            + ". In round brackets: the variant over the baseline at the same shape, device and dtype "
              "(‡: measured in another session than the baseline's, so not in the same run).")
    fitted: dict[str, list[str]] = {}
    for s in data.summaries:
        for r in s.latency.values():
            if r.length != r.requested:
                what = "prompt" if r.phase == "prefill" else f"decode b{r.batch} context"
                fit = f"{what} {r.length} of {r.requested} (max_seq_len {r.max_seq_len})"
                fitted.setdefault(fit, []).append(s.label)
    if fitted:
        text += (" Measured at a smaller shape than asked, the most the model has room for (in square "
                 "brackets): " + "; ".join(f"{fit}: {', '.join(labels)}" for fit, labels in fitted.items()) + ".")
    return text


def overview(data: ReportData) -> list[str]:
    """Short facts about the suite: budget, seeds, noise floor, progress, provenance."""
    s = data.suite
    done = sum(len(x.finished) for x in data.summaries)
    planned = sum(x.planned for x in data.summaries)
    running = sum(x.running for x in data.summaries)
    interrupted = sum(x.interrupted for x in data.summaries)
    diverged = sum(x.diverged for x in data.summaries)
    revisions = sorted({r.code_revision for r in data.rows})
    floor = (f"{data.floor:.4f} (sample std of the baseline's {len(data.baseline.losses)} final losses)"
             if data.floor is not None else "not available (needs at least 2 finished baseline seeds)")
    seeds = s["seeds"]
    budget = (f"Budget: {data.budget:,} tokens" if data.budget is not None else
              f"Budget: {s['budget']['tokens']:,} tokens")
    if data.multi_budget:
        budget += f" (this section; the suite's budgets: {', '.join(f'{b:,}' for b in data.budgets)})"
    return [
        f"Suite: {s['name']} ({s['origin']}), preset {s['preset'] or 'none'}"
        + (f", overrides: {' '.join(data.plan['overrides'])}" if data.plan["overrides"] else ""),
        budget + f", {s['budget']['match']} matching"
        + "".join(f"; {label}: {m}" for label, m in sorted(s["budget"].get("variant_match", {}).items())),
        f"Seeds: baseline init {seeds['baseline']}, variants init {seeds['variants']}, data order "
        + ("= init seed" if seeds["data"] == "init" else f"seed {seeds['data']} for every run")
        + ("; variants paired with the baseline by seed" if all(paired_design(data, x.label)
                                                               for x in data.summaries[1:]) and data.summaries[1:]
           else ""),
        f"Runs: {done} of {planned} finished" + (f", {running} running" if running else "")
        + (f", {interrupted} interrupted (the process training {'it' if interrupted == 1 else 'them'} "
           "is gone; compare resumes from the last checkpoint)" if interrupted else "")
        + (f", {diverged} diverged" if diverged else ""),
        f"Noise floor: {floor}" + ("" if seeds["data"] == "init" or data.floor is None else
                                   "; init seeds only (one data order for every run: data-order noise "
                                   "is not in it, seeds.data: init puts it there)"),
        f"{final_fact(data)}; {verdict_rule(data)}",
        schedule_fact(data),
        mde_fact(data),
        compute_fact(data),
    ] + [f"Stop rule broken: {c['what']} after {plural(c['finished'], 'run')} had finished ({c['at']}): "
         f"{INVALID}" for c in data.seed_changes] + [
        f"Code revision: {', '.join(revisions) or '-'}",
        devices_fact(data.rows),
        latency_fact(data),
    ] + ([_downstream_fact(data)] if data.tasks else []) + (
        data.downstream_verdicts.warnings() if data.downstream_verdicts is not None else [])


def suite_overview(parts: list[ReportData]) -> list[str]:
    """The facts at the top of a report: ``overview`` for a suite with one budget; for several,
    what holds for the whole suite (its budgets, every run, compute, provenance), the rest being
    per budget (``budget_facts``)."""
    if len(parts) == 1:
        return overview(parts[0])
    data = parts[-1]
    s = data.suite
    rows = [r for p in parts for r in p.rows]
    done = sum(len(x.finished) for p in parts for x in p.summaries)
    planned = sum(x.planned for p in parts for x in p.summaries)
    whole = replace(data, rows=rows)
    first = overview(data)  # the suite and seed lines are the same at every budget
    return [
        first[0],
        f"Budgets: {', '.join(f'{b:,}' for b in data.budgets)} tokens, {s['budget']['match']} matching"
        + "".join(f"; {label}: {m}" for label, m in sorted(s["budget"].get("variant_match", {}).items()))
        + "; each (label, seed) trained once per budget, from scratch, with the schedule of its own length",
        first[2],
        f"Runs: {done} of {planned} finished over the budgets",
        verdict_rule(data)[0].upper() + verdict_rule(data)[1:] + ", at each budget on its own",
        compute_fact(whole),
    ] + [f"Stop rule broken: {c['what']} after {plural(c['finished'], 'run')} had finished ({c['at']}): "
         f"{INVALID}" for c in data.seed_changes] + [
        f"Code revision: {', '.join(sorted({r.code_revision for r in rows})) or '-'}",
        devices_fact(rows),
        latency_fact(data),
    ]


def budget_facts(data: ReportData) -> list[str]:
    """What a budget's section of a multi-budget report states above its tables."""
    done = sum(len(x.finished) for x in data.summaries)
    floor = ("-" if data.floor is None else
             f"{data.floor:.4f} (sample std of the baseline's {len(data.baseline.losses)} final losses)")
    return [f"Runs: {done} of {sum(x.planned for x in data.summaries)} finished", schedule_fact(data),
            f"Noise floor: {floor}", final_fact(data), mde_fact(data)] + (
        [_downstream_fact(data)] if data.tasks else []) + (
        data.downstream_verdicts.warnings() if data.downstream_verdicts is not None else [])


def verdict_rule(data: ReportData) -> str:
    """The rule a verdict follows, in one sentence."""
    other = "Holm" if data.adjust == "bonferroni" else "Bonferroni"
    name = "Bonferroni" if data.adjust == "bonferroni" else "Holm"
    return (f"verdict: the paired t-test on the seed pairs a variant shares with the baseline (at "
            f"least 2; the test column says how many), else Welch's; {name}-adjusted p over "
            f"{plural(data.n_tests, 'variant')} < alpha = {data.alpha} decides ({other} shown too)")


def paired_sample_errors(data: ReportData) -> list[float]:
    """Per variant, the final sample's sampling error of its difference from the baseline: from
    the per-batch losses of its first finished run and the baseline run with the same seeds."""
    from archlab.eval.sample_error import paired_sampling_se  # imported when a report is written

    base = {(r.init_seed, r.data_seed): r for r in data.baseline.finished if r.final_val_batches}
    out = []
    for s in data.summaries[1:]:
        for r in s.finished:
            partner = base.get((r.init_seed, r.data_seed))
            if r.final_val_batches and partner is not None:
                se = paired_sampling_se(r.final_val_batches, partner.final_val_batches)
                if se is not None:
                    out.append(se)
                    break
    return out


def schedule_fact(data: ReportData) -> str:
    """The learning-rate schedule the runs used, as the plan recorded it."""
    schedules = [p.get("schedule") for p in data.plan["runs"]]
    base = next((p.get("schedule") for p in data.plan["runs"] if p["label"] == data.baseline.label), None)
    if base is None:
        return "Schedule: not recorded (a plan stored before schedules were; see each run's config)"
    same = all(x == base for x in schedules)
    return (f"Schedule: {base}" + ("" if same else " (the baseline's; iso-FLOP runs of other lengths "
                                   "have the same shape over their own steps)")
            + "; warm-up and decay are fractions of each run's steps unless a fixed warm-up is named")


def final_fact(data: ReportData) -> str:
    """How the final losses were obtained, the final sample's size and its sampling error."""
    rows = [r for x in data.summaries for r in x.finished]
    rules = sorted({r.final_rule or "" for r in rows})
    last_k = data.suite["eval"].get("last_k", 3)
    if not rows:
        return ("Final loss = the final weights on the final evaluation sample" if last_k == 1 else
                f"Final loss = the mean of the last {last_k} evaluations, all in the last 10% of training")
    if rules == [""]:
        return (f"Final loss = mean of the last {plural(last_k, 'evaluation')} (runs recorded before archlab "
                "evaluated the final weights alone: these may average evaluations from well before the end of "
                "training)")
    parts = []
    if FINAL_WEIGHTS in rules:
        sizes = sorted({r.final_val_tokens for r in rows if r.final_val_tokens})
        ses = [r.final_val_se for r in rows if r.final_val_se is not None]
        size = "/".join(f"{n:,}" for n in sizes) or "?"
        text = (f"Final loss = the final weights on a fixed validation sample of {size} tokens (the "
                "validation split's first windows, the same for every run)")
        if ses:
            text += f"; its sampling standard error {statistics.median(ses):.4f} (median over runs)"
        paired = paired_sample_errors(data)
        if paired:
            se = statistics.median(paired)
            text += (f", in a variant's difference from the baseline on the same sample (what a paired verdict "
                     f"rests on) {se:.4f} (median over variants)")
            if data.floor:
                text += f", {se / data.floor:.2f} noise floors"
        parts.append(text)
    smoothed = [x for x in rules if x and x != FINAL_WEIGHTS]
    if smoothed:
        parts.append("final loss = " + "; ".join(smoothed) + " (within the last 10% of training)")
    if "" in rules:
        parts.append("some runs were recorded under the old rule (mean of the last evaluations)")
    return "; ".join(parts)


def mde_fact(data: ReportData) -> str:
    """The smallest difference the suite's seeds can detect: the paired tests' own (from each
    variant's differences), where variants are decided paired, and the unpaired planning figure
    from the noise floor."""
    if data.floor is None:
        return "Minimum detectable effect: not available (needs the noise floor)"
    paired = [(x.label, x.comparison.mde) for x in data.summaries[1:]
              if x.comparison is not None and x.comparison.method == "paired" and x.comparison.mde is not None]
    n_var = sorted({x.planned for x in data.summaries[1:]}) or [0]
    parts = []
    for nv in n_var:
        mde = mde_unpaired(data.floor, data.baseline.planned, nv, data.alpha / data.n_tests)
        if mde is not None:
            parts.append(f"{mde:.4f} ({mde / data.floor:.1f} noise floors) with {data.baseline.planned} "
                         f"baseline and {nv} variant seeds")
    head = f"Minimum detectable effect (power {POWER:g}, two-sided alpha / {data.n_tests}): "
    if paired:
        values = [m for _, m in paired]
        head += (f"paired, from the variants' own differences, {min(values):.4f}"
                 + (f" to {max(values):.4f}" if len(values) > 1 else f" ({paired[0][0]})")
                 + "; unpaired, planned from the noise floor, ")
    else:
        head += "unpaired, from the noise floor, "
    return head + ("; ".join(parts) or "-") + "; the MDE column gives each variant's, from its deciding test"


def compute_fact(data: ReportData) -> str:
    """Suite wall time (summed over runs, and first start to last finish) and GPU-hours."""
    wall, hours = compute_hours(data.rows)
    ended = [r.finished_at for r in data.rows if r.finished_at is not None]
    span = (f"; {duration(max(ended) - min(r.started_at for r in data.rows))} from the first start to the "
            "last finish" if ended else "")
    return f"Compute: {duration(wall)} of run wall time, {hours:.3f} GPU-hours{span}"


def devices_fact(rows: list[RunRow]) -> str:
    """What trained the runs: each distinct device with its number of runs."""
    counts = Counter(device_text(r.device) for r in rows if r.device)
    if not counts:
        return "Device: -"
    parts = [f"{d} ({plural(n, 'run')})" for d, n in sorted(counts.items())]
    return f"Device{'s' if len(parts) > 1 else ''}: {'; '.join(parts)}"


def _downstream_fact(data: ReportData) -> str:
    limit = data.suite["eval"].get("limit")
    finished = sum(len(x.finished) for x in data.summaries)
    evaluated = len({d.run_id for x in data.summaries for rows in x.downstream.values() for d in rows})
    return (f"Downstream (zero-shot, final checkpoints): {', '.join(data.tasks)}; "
            + (f"first {limit} items per task" if limit else "every item")
            + f"; {evaluated} of {finished} finished runs evaluated")


METHOD_NOTE = (
    "Δ = mean(variant) - mean(baseline) of the final validation loss (negative is better); "
    "z = Δ / noise floor. Runs with the same init and data seeds are pairs. p paired: the paired "
    "t-test on the per-pair differences (n = pairs); p unpaired: Welch's t-test when both sides have "
    "at least 2 seeds, with a single seed on one side the pooled two-sample t-test (the "
    "prediction-interval test of one observation against a sample, assuming equal seed noise). "
    "Test: the one that decides: paired on every seed pair the variant shares with the baseline when "
    "there are at least 2 (a seed one side lacks is left out of it, but the baseline's stays in the "
    "noise floor), else unpaired; the 95% CI is the deciding test's and is not adjusted. p Bonferroni = min(1, p × number of variants); p Holm: Holm's step-down adjustment "
    "(a variant without a p yet counts as the largest). The suite's eval.adjust names the one that "
    "decides: a variant is better or worse only if it is below alpha. MDE: the smallest true "
    "difference the deciding test detects with power 0.8 at two-sided alpha / number of variants, "
    "for the planned seeds (unpaired: from the noise floor; paired: from the sd of the variant's "
    "differences). Seeds are fixed in the suite file before the runs; a plan changed after results "
    "voids the verdicts (see the overview)."
)


COSTS_NOTE = (
    "Train tokens/s: end-to-end training throughput of one run (its tokens over its wall time, "
    "evaluations and checkpoints included), median over the variant's finished seeds. It depends "
    "on what else the machine was doing: runs at once is the most runs this host was training at "
    "the same time while a run trained (compare --jobs, other compares sharing the host; sampled, "
    "- where not recorded), so rates measured under a different load or on another device (see "
    "the device line) are not comparable. The FLOP and byte columns are computed, not measured."
)


DOWNSTREAM_NOTE = (
    "Zero-shot accuracy of each run's final checkpoint: acc_norm (the choice with the highest "
    "log-likelihood per character of the choice, lm-evaluation-harness' definition; scores stored "
    "before archlab 2026-12-02 divided by the UTF-8 bytes of the continuation with its leading "
    "space) for multiple-choice tasks, acc (the target greedily right, exact match) "
    "for LAMBADA-style tasks. Mean over seeds ± its standard error over seeds (sample standard "
    "deviation / √seeds); † a single seed: the binomial standard error over the task's items "
    "instead. The results table gives the variant's difference against the baseline's mean in "
    "brackets."
)


DOWNSTREAM_VERDICTS_NOTE = (
    "Downstream verdicts, one per task family: a run's family score is the mean of its tasks' "
    "headline metric; Δ = mean(variant) - mean(baseline) (positive is better), tested like the loss "
    "(paired on shared seed pairs, at least 2, else Welch's), Holm's step-down over every variant x "
    "family test decides at alpha. Chance: the metric's value for a guessing model (mean over items "
    "of 1 / choices; 0 for exact match). When the baseline's family mean is within twice its "
    "standard error (seeds and items combined) of chance, no verdict is drawn on that family."
)


HELDOUT_NOTE = (
    "Validation loss (nats/token) of each run's final checkpoint on the validation split of each "
    "extra corpus named in the suite's eval_data (prepared with the suite's tokenizer), next to the "
    "in-distribution loss; mean over seeds, a variant's difference against the baseline in brackets. "
    "No significance test is made on these."
)


COMPUTE_NOTE = (
    "Wall time: each run's training wall time as the trainer reports it, summed. GPU-hours: that "
    "wall time for runs on a GPU (one device per run; runs that shared a GPU, see runs at once, are "
    "each counted in full, so this is an upper bound); CPU runs count none. A verdict's cost is the "
    "variant's runs plus the baseline's."
)

