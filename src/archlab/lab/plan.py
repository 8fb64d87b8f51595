"""From a suite to a list of fully built runs: configs, budgets, costs and run ids.

Planning builds and validates every run's ``RunConfig`` up front, so an unknown variant key, a
budget too small for the warm-up or a final loss smoothed over more than the last 10% of training
fails before anything trains. It also fixes each run's identity: the run id is a hash of (suite
name, label, init seed, data seed, config hash), so a resumed suite finds its rows and a changed
config (budget, ``--set``) gets new rows instead of reusing old results.

A suite with several token budgets plans every (label, seed) once per budget: separate runs, each
trained from scratch with the schedule of its own length (warm-up and decay are fractions of its
steps), never a longer run cut short.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from archlab.config import ModelConfig, RunConfig, config_from_dict, make_config, parse_override
from archlab.errors import ConfigError
from archlab.lab.store import COST_KEYS
from archlab.lab.suite import Suite
from archlab.typed import merge

CostsFn = Callable[..., dict[str, Any]]

# Keys the suite owns: a base, variant or --set value for them would be silently replaced.
_RESERVED = {("train", "seed"): "seeds.baseline / seeds.variants",
             ("train", "steps"): "budget.tokens", ("data", "seed"): "seeds.data"}
_PROVISIONAL_STEPS = 10**9  # only to read a config's tokens per step before the budget is known


@dataclass(frozen=True)
class PlannedRun:
    run_id: str
    label: str
    role: Literal["baseline", "variant"]
    init_seed: int
    data_seed: int
    config: RunConfig
    config_hash: str  # of the config with a suite-managed data path made relative (portable)
    tokens: int  # steps * tokens per step
    costs: dict[str, float]
    cost_context: int
    budget: int = 0  # the suite budget (baseline tokens) this run belongs to

    @property
    def steps(self) -> int:
        return self.config.train.steps


@dataclass(frozen=True)
class DataJob:
    """A corpus the suite prepares into its own directory when missing."""

    path: Path
    source: str  # a ``prepare`` source spec; unused when ``recipe`` is set
    vocab_size: int
    max_bytes: int | None
    recipe: str | None = None  # a corpus recipe (``archlab data recipes``) instead of ``source``

    def describe(self) -> str:
        return f"recipe {self.recipe}" if self.recipe is not None else self.source


@dataclass(frozen=True)
class Plan:
    suite: Suite
    out_dir: Path
    overrides: tuple[str, ...]
    runs: tuple[PlannedRun, ...]
    data_jobs: tuple[DataJob, ...]

    @property
    def labels(self) -> list[str]:
        return [self.suite.baseline, *self.suite.variants]

    def meta(self) -> dict[str, Any]:
        """What the report needs besides the rows, stored in the database's ``meta`` table."""
        return {
            "suite": self.suite.to_dict(),
            "overrides": list(self.overrides),
            "labels": self.labels,
            "runs": [{"run_id": r.run_id, "label": r.label, "role": r.role, "init_seed": r.init_seed,
                      "data_seed": r.data_seed, "tokens": r.tokens, "steps": r.steps, "costs": r.costs,
                      "cost_context": r.cost_context, "budget": r.budget,
                      "schedule": r.config.train.schedule_text()}
                     for r in self.runs],
        }


def _real_costs() -> CostsFn:
    from archlab.model.accounting import costs

    return costs


def _check_reserved(tree: dict[str, Any], where: str, suite: Suite) -> None:
    for (section, key), owner in _RESERVED.items():
        values = tree.get(section)
        if isinstance(values, dict) and key in values:
            raise ConfigError(f"suite error: {suite.origin}: {where}: {section}.{key} is set by the "
                              f"suite ({owner}); remove it here")
    if suite.data is not None and isinstance(tree.get("data"), dict) and "path" in tree["data"]:
        raise ConfigError(f"suite error: {suite.origin}: {where}: data.path is managed by the suite's "
                          "data section; remove one of them")


def _portable_hash(cfg: RunConfig, out_dir: Path) -> str:
    """Config hash with a data path inside the suite directory made relative to it, so moving
    or copying a suite directory keeps its run ids (and its finished results)."""
    tree = cfg.to_dict()
    path = Path(tree["data"]["path"])
    if path.is_absolute() and path.is_relative_to(out_dir):
        tree["data"]["path"] = str(path.relative_to(out_dir))
    blob = json.dumps(tree, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def adopt_recorded_ids(plan: Plan, recorded: Iterable[Any]) -> Plan:
    """``plan`` with each run that ``recorded`` (the suite's store rows) holds under another id
    renamed to that id, when the recorded config, read by this archlab, is the planned one.

    A run id hashes the config's text, and an archlab that gained an option writes one more key
    (or, with ``LATER_FIELDS``, one fewer) for the same experiment: without this, a suite resumed
    after an upgrade would not find its finished runs and would train them all again. Only rows of
    the same suite, label and seeds whose config parses and hashes like the planned run's count; a
    planned run whose own id is recorded keeps it."""
    rows = [r for r in recorded if r.suite == plan.suite.name]
    have = {r.run_id for r in rows}
    taken = {r.run_id for r in plan.runs}
    candidates: dict[tuple[str, int, int], list[Any]] = {}
    for row in rows:
        if row.run_id not in taken:
            candidates.setdefault((row.label, row.init_seed, row.data_seed), []).append(row)
    if not candidates:
        return plan
    runs = []
    for run in plan.runs:
        if run.run_id not in have:
            for row in candidates.get((run.label, run.init_seed, run.data_seed), []):
                if row.run_id not in taken and _recorded_hash(row.config, run, plan.out_dir) == run.config_hash:
                    taken.add(row.run_id)
                    run = replace(run, run_id=row.run_id)
                    break
        runs.append(run)
    return replace(plan, runs=tuple(runs))


def _recorded_hash(tree: dict[str, Any], run: PlannedRun, out_dir: Path) -> str | None:
    """The portable hash of a recorded config as this archlab reads it (None when it no longer
    parses). A suite-managed data path recorded under another suite directory (the same suite
    copied or moved, e.g. to a GPU machine and back) counts as the planned one."""
    tree = json.loads(json.dumps(tree))
    planned = Path(run.config.data.path)
    recorded = Path(str(tree.get("data", {}).get("path", "")))
    if planned.is_relative_to(out_dir):
        inside = planned.relative_to(out_dir)
        if recorded.parts[-len(inside.parts):] == inside.parts:
            tree["data"]["path"] = str(planned)
    try:
        cfg = config_from_dict(tree)
    except ConfigError:
        return None
    return _portable_hash(cfg, out_dir)


def data_dir_name(suite: Suite, vocab_size: int) -> str:
    """Name of a suite-managed data directory: everything that changes the prepared tokens
    (source, size, vocabulary) is in it, so changing any of them prepares new data and, through
    data.path, gives new run ids instead of silently reusing results on other data."""
    assert suite.data is not None
    source = suite.data.recipe or suite.data.source
    slug = re.sub(r"[^A-Za-z0-9_.+-]+", "_", source).strip("_.")[-40:] or "data"
    if slug != source:  # a path or pattern: keep it readable, and unique through a hash
        slug += "-" + hashlib.sha256(source.encode()).hexdigest()[:8]
    mb = suite.data.max_mb
    size = "default" if mb is None else "all" if mb == 0 else f"{mb:g}MB"
    return f"{slug}-{size}-v{vocab_size}"


class _CostCache:
    """``costs`` per distinct model config and context (variants often share the baseline's)."""

    def __init__(self, fn: CostsFn, dtype_bytes: int) -> None:
        self.fn, self.dtype_bytes = fn, dtype_bytes
        self._cache: dict[str, dict[str, Any]] = {}

    def __call__(self, model: ModelConfig, context: int) -> dict[str, Any]:
        key = json.dumps([model.to_dict(), context], sort_keys=True)
        if key not in self._cache:
            out = self.fn(model, context, batch=1, dtype_bytes=self.dtype_bytes)
            missing = [k for k in COST_KEYS if k not in out]
            if missing:
                raise RuntimeError(f"archlab.model.accounting.costs returned no {', '.join(missing)}")
            self._cache[key] = out
        return self._cache[key]

    def columns(self, cfg: RunConfig, context: int) -> dict[str, float]:
        """Training FLOPs at the training length; serving costs at the suite's stated context."""
        train = self(cfg.model, cfg.train.seq_len)
        serve = self(cfg.model, context)
        out = {k: serve[k] for k in COST_KEYS}
        out["train_flops_per_token"] = train["train_flops_per_token"]
        return out


def build_plan(suite: Suite, out_dir: Path, overrides: list[str] | tuple[str, ...] = (),
               costs_fn: CostsFn | None = None) -> Plan:
    """Build, validate and cost every run of ``suite``; raises ConfigError before any work."""
    out_dir = Path(out_dir).resolve()
    over_tree: dict[str, Any] = {}
    for item in overrides:
        over_tree = merge(over_tree, parse_override(item))
    _check_reserved(suite.base, "base", suite)
    _check_reserved(over_tree, "--set", suite)
    eval_tree: dict[str, Any] = {"train": {}}
    if suite.eval.every is not None:
        eval_tree["train"]["eval_every"] = suite.eval.every
    if suite.eval.batches is not None:
        eval_tree["train"]["eval_batches"] = suite.eval.batches
    if suite.eval.final_tokens is not None:
        eval_tree["train"]["final_eval_tokens"] = suite.eval.final_tokens

    def build(label: str, init_seed: int, data_seed: int, steps: int,
              schedule: dict[str, int] | None = None) -> RunConfig:
        where = "base" if label == suite.baseline else f"variants.{label}"
        variant: dict[str, Any] = {}
        if label != suite.baseline:
            try:
                variant = suite.variant_tree(label)
            except ConfigError as e:
                raise ConfigError(f"suite error: {suite.origin}: {where}: {e}") from None
            _check_reserved(variant, where, suite)
        tree = merge(merge(merge(suite.base, eval_tree), variant), over_tree)
        tree = merge(tree, {"train": {"seed": init_seed, "steps": steps, **(schedule or {})},
                            "data": {"seed": data_seed}})
        try:
            cfg = make_config(suite.preset, extra=tree)
        except ConfigError as e:
            hint = "" if steps == _PROVISIONAL_STEPS else f" (budget gives {steps} steps)"
            raise ConfigError(f"suite error: {suite.origin}: {where}: {e}{hint}") from None
        if suite.data is not None:
            cfg.data.path = str(out_dir / "data" / data_dir_name(suite, cfg.model.vocab_size))
        return cfg

    # Pass 1: every label's config without a budget, to get tokens per step and model sizes.
    probe = {label: build(label, 0, 0, _PROVISIONAL_STEPS) for label in [suite.baseline, *suite.variants]}
    cache = _CostCache(costs_fn or _real_costs(), suite.costs.dtype_bytes)
    costs = {label: cache.columns(cfg, suite.costs.context or cfg.train.seq_len)
             for label, cfg in probe.items()}
    base_fpt = costs[suite.baseline]["train_flops_per_token"]

    def token_scale(label: str) -> float:
        if suite.budget.match_for(label) != "iso-flop":
            return 1.0
        return base_fpt / costs[label]["train_flops_per_token"]

    def steps_for(label: str, budget: int) -> int:
        return max(1, round(budget * token_scale(label) / probe[label].train.tokens_per_step))

    def schedule_for(label: str, steps: int) -> dict[str, int] | None:
        """An iso-FLOP run shorter or longer than its iso-token self keeps its schedule's shape:
        evaluations (and a fixed warm-up, where a config sets one; the default warm-up is already a
        fraction of the steps) at the same fractions of training. The label's own settings are its
        probe's."""
        scale = token_scale(label)
        if scale == 1.0:
            return None
        own = probe[label].train
        out = {"eval_every": max(1, round(own.eval_every * scale))}
        if own.warmup_steps is not None:
            out["warmup_steps"] = min(steps, round(own.warmup_steps * scale))
        return out

    # Pass 2: the runs, interleaved by seed index so partial results cover every label early.
    runs: list[PlannedRun] = []
    seed_lists = {suite.baseline: suite.seeds.baseline, **{v: suite.seeds.variants for v in suite.variants}}
    # Budgets in ascending order: the short runs, which give a first verdict soonest, come first.
    for budget in suite.budget.tokens:
        for i in range(max(len(s) for s in seed_lists.values())):
            for label, seeds in seed_lists.items():
                if i >= len(seeds):
                    continue
                init_seed = seeds[i]
                data_seed = suite.seeds.data_seed(init_seed)
                steps = steps_for(label, budget)
                cfg = build(label, init_seed, data_seed, steps, schedule=schedule_for(label, steps))
                check_smoothing(suite, label, cfg)
                chash = _portable_hash(cfg, out_dir)
                ident = json.dumps([suite.name, label, init_seed, data_seed, chash])
                digest = hashlib.sha256(ident.encode()).hexdigest()[:10]
                tag = f"-{_budget_tag(budget)}" if len(suite.budget.tokens) > 1 else ""  # readable apart
                run_id = f"{label}{tag}-s{init_seed}-d{data_seed}-{digest}"
                runs.append(PlannedRun(
                    run_id=run_id, label=label,
                    role="baseline" if label == suite.baseline else "variant",
                    init_seed=init_seed, data_seed=data_seed, config=cfg, config_hash=chash,
                    tokens=cfg.train.steps * cfg.train.tokens_per_step, costs=costs[label],
                    cost_context=suite.costs.context or cfg.train.seq_len, budget=budget))

    jobs: dict[Path, DataJob] = {}
    if suite.data is not None:
        max_bytes = None if suite.data.max_mb is None else int(suite.data.max_mb * 1_000_000)
        for r in runs:
            path = Path(r.config.data.path)
            jobs[path] = DataJob(path=path, source=suite.data.source, vocab_size=r.config.model.vocab_size,
                                 max_bytes=max_bytes, recipe=suite.data.recipe)
    return Plan(suite=suite, out_dir=out_dir, overrides=tuple(overrides), runs=tuple(runs),
                data_jobs=tuple(jobs.values()))


def _budget_tag(tokens: int) -> str:
    """A budget in a run id: ``6.55M``, ``57M``, ``410k``."""
    for div, unit in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if tokens >= div:
            return f"{tokens / div:.3g}{unit}"
    return str(tokens)


def evaluation_steps(steps: int, every: int) -> list[int]:
    """The steps at which training evaluates: every ``every`` steps and at the last step."""
    return sorted(set(range(every, steps + 1, every)) | {steps})


SMOOTHING_WINDOW = 0.1  # a smoothed final loss may only average evaluations of the last 10%


def check_smoothing(suite: Suite, label: str, cfg: RunConfig) -> None:
    """Refuse ``eval.last_k > 1`` whose evaluations reach back further than the last 10% of a
    run: such a "final" loss would average models from earlier in training, and a variant that
    learns faster early but ends level would be called better."""
    k = suite.eval.last_k
    if k == 1:
        return
    tc = cfg.train
    shown = evaluation_steps(tc.steps, tc.eval_every)[-k:]
    start = tc.steps * (1 - SMOOTHING_WINDOW)
    if len(shown) < k or shown[0] < start:
        every = max(1, int(tc.steps * SMOOTHING_WINDOW / (k - 1)))
        where = (f"steps {shown[0]}-{shown[-1]}" if len(shown) == k
                 else f"more evaluations than the run's {len(shown)}")
        raise ConfigError(
            f"suite error: {suite.origin}: eval.last_k: the last {k} evaluations of {label} ({tc.steps} steps) "
            f"span {where}, more than the last 10% of training; set eval.last_k: 1 (the final weights, the "
            f"default) or eval.every: {every} or less")


def select(plan: Plan, variants: list[str] | None) -> list[PlannedRun]:
    """The runs to train now: the baseline's always, and the chosen variants (all by default)."""
    if variants is None:
        return list(plan.runs)
    unknown = [v for v in variants if v not in plan.suite.variants]
    if unknown:
        raise ConfigError(f"suite error: {plan.suite.origin}: --variants: unknown variant {unknown[0]!r}; "
                          f"this suite has: {', '.join(plan.suite.variants) or '(none)'}")
    chosen = set(variants) | {plan.suite.baseline}
    return [r for r in plan.runs if r.label in chosen]


def parse_shard(spec: str) -> tuple[int, int]:
    """``--shard I/N`` as ``(I, N)``, with 0 <= I < N."""
    index_s, sep, count_s = spec.partition("/")
    if not (sep and index_s.strip().isdigit() and count_s.strip().isdigit()):
        raise ConfigError(f"--shard {spec!r}: expected I/N, e.g. 0/2 (share I of N, counted from 0)")
    index, count = int(index_s), int(count_s)
    if not 0 <= index < count:
        raise ConfigError(f"--shard {spec}: needs 0 <= I < N (the shards of N are 0/N to N-1/N)")
    return index, count


def shard_ids(plan: Plan, index: int, count: int) -> set[str]:
    """The run ids of shard ``index`` of ``count``: a partition of the whole plan (every run in
    exactly one shard), a function of the plan alone, so machines that build the same plan agree
    on it without talking to each other.

    The runs are dealt round-robin in label-major order (the baseline's runs in seed order, then
    each variant's), not in the plan's interleaved order: dealt interleaved, a shard count equal
    to the number of labels would give each machine one label, so no shard alone could compare
    anything and the machines' loads would differ by the labels' costs. Label-major, every label's
    runs are spread over the shards (each gets its count / N, rounded either way) and the shard
    sizes differ by at most one. The whole plan is dealt, not ``--variants``' selection, so a
    run's shard never depends on what a machine chose to train."""
    by_label = sorted(plan.runs, key=lambda r: plan.labels.index(r.label))  # stable: seed order kept
    return {r.run_id for i, r in enumerate(by_label) if i % count == index}
