"""Typed configuration: dataclasses, YAML files, ``--set key.sub=value`` overrides, presets.

Every config is a tree of dataclasses: ``model`` (``archlab.model.config.ModelConfig``, whose
variant sections belong to the variants), ``data`` and ``train``. Loading checks each key and
value against the field's annotation (``archlab.typed``), so a typo or a bad value fails with one
line naming the key and what is allowed (``ConfigError``, exit code 2) before anything is
written. Cross-field rules live in each dataclass's ``validate``. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from archlab.errors import ConfigError
from archlab.model.config import ModelConfig
from archlab.typed import build, check, merge


# --------------------------------------------------------------------------------------------
# Data and training
# --------------------------------------------------------------------------------------------
#: the largest seed: what a signed 64-bit integer (SQLite, torch.manual_seed) holds
MAX_SEED = 2**63 - 1


@dataclass
class DataConfig:
    path: str = "data/stdlib"  # a prepared data directory (archlab data prepare)
    seed: int = 0  # data-order seed, separate from the init seed

    def validate(self) -> None:
        check(0 <= self.seed <= MAX_SEED, "data.seed", f"must be in 0..{MAX_SEED}, got {self.seed}")


@dataclass
class TrainConfig:
    seed: int = 0  # initialisation seed
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    # The schedule scales with the run: warm-up is a fraction of train.steps and the decay fills
    # the rest (cosine) or its last decay_frac (wsd), so a 400-step run and a 40,000-step run have
    # the same shape. A fixed warm-up of 200 steps would be half of a 400-step run: a comparison
    # would then measure how each variant copes with a schedule nobody would choose. 5% is what
    # the presets' fixed warm-ups were at their own default lengths (200 of 4000 steps at 20m,
    # 500 of 10000 at 124m), and at 400 steps still 20 steps, the 1 / (1 - beta2) steps AdamW's
    # second moment takes to settle at beta2 = 0.95.
    warmup_frac: float = 0.05
    # A fixed warm-up in steps instead of warmup_frac (None: the fraction). `preset` names the
    # preset's former fixed warm-up (PRESET_WARMUP_STEPS), resolved when the config is made.
    warmup_steps: int | None = None
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_frac: float = 0.2  # wsd: fraction of steps in the final decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8  # the evaluations during training: this many batches (the loss curve)
    # The final evaluation, once, of the final weights: the validation split's first windows up to
    # this many tokens (the whole split when it is smaller). It is the run's final loss, so it is
    # larger than the curve's sample: its own sampling error must be small beside seed noise.
    final_eval_tokens: int = 1_048_576
    ckpt_every: int = 100
    keep_ckpts: int = 2
    # Start from another checkpoint's weights (a converted or imported model, or another run's)
    # instead of a random initialisation; the optimizer and the schedule start at step 0. Only
    # for a new run: a resumed one continues from its own checkpoint. ``archlab train
    # --init-from`` also takes the checkpoint's model section as this run's.
    init_from: str | None = None
    log_every: int = 10
    compile: bool = False
    # replay the whole step as one CUDA graph after a few warm-up steps (CUDA only; for models
    # whose step is host-bound, e.g. AttnRes's graph-broken routing reads; train/cuda_graph.py)
    cuda_graph: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    threads: int = 0  # CPU threads for torch (0 = torch's default)
    # Several processes (torchrun; docs/distributed.md). These say how a run is laid out over
    # processes, not what it computes, so they are left out of the config hash (LAYOUT_FIELDS).
    # none: one process; under torchrun (WORLD_SIZE > 1) "none" means ddp, the layout that
    # needs no choice. ddp: every rank holds the whole model. fsdp: parameters, gradients and
    # optimizer state sharded over the ranks (FSDP2, one unit per block).
    parallel: Literal["none", "ddp", "fsdp"] = "none"
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # The loss without the [B, T, V] logits kept for the backward (kernels/linear_cross_entropy.py:
    # chunked, the head's product recomputed in the backward): the same loss, less memory; rows
    # kinds without statistics-only losses read out as usual. None (auto): where the rows kind
    # says it pays (``fused_readout_by_default``: the decode branch, whose two readouts keep two
    # logits tensors; on an H200 at 124m its peak fell from 49.7 to 32.9 GiB at 1.03x the
    # tokens/s, while the baseline's peak did not move and its rate was 0.97x, docs/benchmarks.md).
    fused_readout: bool | None = None
    dist_timeout_s: int = 600  # a collective that waits longer than this fails the run

    #: fields that choose a layout over processes or how the same loss is computed; equal runs
    #: with different layouts resume each other's checkpoints, and a config at their defaults
    #: hashes as it did before they existed
    LAYOUT_FIELDS = ("parallel", "activation_checkpointing", "dist_timeout_s", "fused_readout")
    #: fields added after runs were recorded whose default computes what those runs computed: at
    #: their defaults they are left out of the config, so a suite's run ids (a hash of it) stay
    #: the same and its finished runs are found again after an upgrade. A new field whose default
    #: keeps the old behaviour belongs here (tests/lab/test_run_ids_stable.py holds the ids)
    LATER_FIELDS = ("init_from",)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    @property
    def warmup(self) -> int:
        """Warm-up steps of this run: ``warmup_steps`` when set, else ``warmup_frac`` of ``steps``."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(self.warmup_frac * self.steps)

    def schedule_text(self) -> str:
        """The learning-rate schedule in words, as reports state it."""
        warm = (f"fixed warm-up of {self.warmup_steps} steps" if self.warmup_steps is not None
                else f"warm-up {self.warmup_frac:.0%} of the steps ({self.warmup})")
        decay = {"cosine": f"cosine decay to {self.min_lr_ratio:g}x over the rest",
                 "wsd": f"constant, then linear decay to {self.min_lr_ratio:g}x over the last "
                        f"{self.decay_frac:.0%}",
                 "constant": "constant after"}[self.schedule]
        return f"{warm}, {decay}"

    def validate(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum", "steps", "eval_every", "eval_batches",
                     "final_eval_tokens", "ckpt_every", "keep_ckpts", "log_every"):
            check(getattr(self, name) > 0, f"train.{name}", "must be positive")
        check(0 <= self.seed <= MAX_SEED, "train.seed", f"must be in 0..{MAX_SEED}, got {self.seed}")
        check(self.lr > 0 and math.isfinite(self.lr), "train.lr", f"must be a positive finite number, got {self.lr}")
        # torch's AdamW raises on these only when the optimizer is built, after the run directory
        # is written; a negative decay or clip would train silently on flipped updates or gradients
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            check(0 <= value < 1, f"train.{name}", f"must be in [0, 1), got {value}")
        check(0 <= self.weight_decay and math.isfinite(self.weight_decay), "train.weight_decay",
              f"must be a finite number >= 0, got {self.weight_decay}")
        check(self.grad_clip > 0 and math.isfinite(self.grad_clip), "train.grad_clip",
              f"must be a positive finite number (the largest gradient norm), got {self.grad_clip}")
        if self.warmup_steps is not None:
            check(0 <= self.warmup_steps <= self.steps, "train.warmup_steps",
                  f"must be in 0..steps={self.steps} (or null: train.warmup_frac of the steps)")
        check(0 <= self.warmup_frac < 1, "train.warmup_frac", f"must be in [0, 1), got {self.warmup_frac}")
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        check(0 < self.decay_frac <= 1, "train.decay_frac", "must be in (0, 1]")
        check(self.dist_timeout_s > 0, "train.dist_timeout_s", f"must be positive, got {self.dist_timeout_s}")
        check(self.threads >= 0, "train.threads", f"must be >= 0 (0 = torch's default), got {self.threads}")
        check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               "train.device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> "RunConfig":
        self.model.validate()
        self.train.validate()
        self.data.validate()
        check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
               f"must be <= model.max_seq_len={self.model.max_seq_len}")
        if self.train.parallel != "none":
            # A layer no visit runs has parameters without gradients: DDP's reducer waits for them
            # and FSDP's units never reduce them. Not supported rather than hanging a job.
            from archlab.model.core.spec import layer_visits

            skipped = sorted(set(range(self.model.n_layers)) - set(layer_visits(self.model)))
            check(not skipped, "train.parallel",
                  f"{self.train.parallel} cannot train model.schedule {self.model.schedule!r}, which skips "
                  f"layers {skipped}: train it in one process (train.parallel none)")
        return self

    def to_dict(self) -> dict[str, Any]:
        # Layout fields and later fields at their defaults are left out, so that configs, run ids
        # and hashes stay what they were before the fields existed.
        optional = TrainConfig.LAYOUT_FIELDS + TrainConfig.LATER_FIELDS
        train = {k: v for k, v in dataclasses.asdict(self.train).items()
                 if k not in optional or v != getattr(_TRAIN_DEFAULTS, k)}
        return {"model": self.model.to_dict(), "data": dataclasses.asdict(self.data), "train": train}

    def hash(self) -> str:
        """A stable hash of everything that changes what a run computes (not its layout over
        processes: a run saved by 2 processes resumes on 1 and the other way round)."""
        tree = self.to_dict()
        tree["train"] = {k: v for k, v in tree["train"].items() if k not in TrainConfig.LAYOUT_FIELDS}
        blob = json.dumps(tree, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_TRAIN_DEFAULTS = TrainConfig()


# --------------------------------------------------------------------------------------------
# Presets: tiny trains on a laptop CPU in minutes; the others are GPU sizes. Their warm-up is the
# default fraction of the run (train.warmup_frac); the fixed warm-ups they had before it are kept
# by name: `--set train.warmup_steps=preset`.
# --------------------------------------------------------------------------------------------
PRESET_WARMUP_STEPS: dict[str, int] = {"tiny": 30, "20m": 200, "70m": 200, "124m": 500, "350m": 1000,
                                        "1b": 2000}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {"vocab_size": 4096, "d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 256},
        "train": {"batch_size": 16, "seq_len": 128, "steps": 300, "lr": 3e-3, "eval_every": 100,
                  "ckpt_every": 100},
    },
    "20m": {
        "model": {"vocab_size": 8192, "d_model": 384, "n_layers": 8, "n_heads": 6, "n_kv_heads": 6,
                  "max_seq_len": 1024},
        "train": {"batch_size": 32, "seq_len": 512, "steps": 4000, "lr": 1.5e-3, "eval_every": 250,
                  "ckpt_every": 1000, "compile": True},
    },
    # 60-80M, the second size of the paired verdict suites (verdicts-70m): 12 x 576, head dim 64.
    "70m": {
        "model": {"vocab_size": 16384, "d_model": 576, "n_layers": 12, "n_heads": 9, "n_kv_heads": 9,
                  "max_seq_len": 1024},
        "train": {"batch_size": 32, "seq_len": 512, "steps": 6000, "lr": 1e-3, "eval_every": 250,
                  "ckpt_every": 1000, "compile": True},
    },
    "124m": {
        "model": {"vocab_size": 50304, "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12,
                  "max_seq_len": 1024},
        "train": {"batch_size": 32, "seq_len": 1024, "steps": 10000, "lr": 6e-4, "eval_every": 500,
                  "ckpt_every": 2000, "compile": True},
    },
    "350m": {
        "model": {"vocab_size": 50304, "d_model": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 16,
                  "max_seq_len": 1024},
        "train": {"batch_size": 16, "seq_len": 1024, "grad_accum": 2, "steps": 20000, "lr": 3e-4,
                  "eval_every": 1000, "ckpt_every": 2000, "compile": True},
    },
    "1b": {
        "model": {"vocab_size": 50304, "d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                  "max_seq_len": 2048},
        "train": {"batch_size": 8, "seq_len": 2048, "grad_accum": 4, "steps": 30000, "lr": 3e-4,
                  "eval_every": 1000, "ckpt_every": 2000, "compile": True},
    },
}


# --------------------------------------------------------------------------------------------
# Loading and overriding
# --------------------------------------------------------------------------------------------
def parse_override(item: str) -> dict[str, Any]:
    """``model.n_layers=8`` -> ``{"model": {"n_layers": 8}}``; the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"config error: override {item!r} must look like key.sub=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"config error: override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    tree: dict[str, Any] = {parts[-1]: value}
    for p in reversed(parts[:-1]):
        tree = {p: tree}
    return tree


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line, self.first_line = key, line, first_line


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping. PyYAML keeps the last
    value silently, so ``train: {lr: 1e-3, lr: 2e-3}`` would train at 2e-3 while the file seems to
    say both. Keys a merge (``<<: *anchor``) brings in may be overridden: that is what merging is for."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}  # key -> its line (0-based)
        for key_node, _ in node.value:  # before the base class flattens merges into this list
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if first is not None:
                raise _DuplicateKey(key, key_node.start_mark.line + 1, first + 1)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str, origin: str, what: str = "config") -> Any:
    """YAML ``text`` (from ``origin``, a file name for messages) parsed with ``UniqueKeyLoader``;
    bad YAML or a duplicated key is one ``{what} error`` line naming the origin and the line."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as e:
        raise ConfigError(f"{what} error: {origin} line {e.line}: key {e.key!r} is given twice in one mapping "
                          f"(first on line {e.first_line}); YAML would keep only the last value: remove "
                          "one") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError(f"{what} error: {origin} is not valid YAML{where}") from None


def load_yaml(path: str | Path, what: str = "config") -> dict[str, Any]:
    """The mapping a YAML file holds (``{}`` for an empty file); ``what`` names the file's kind in
    errors (``config``, ``suite``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} error: {what} file {str(p)!r} does not exist")
    data = load_yaml_text(p.read_text(), str(p), what)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} error: {p} must hold a mapping at the top level")
    return data


def make_config(
    preset: str | None = "tiny",
    files: list[str | Path] | None = None,
    overrides: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> RunConfig:
    """Preset, then YAML files in order, then ``extra`` (a dict), then ``--set`` overrides."""
    tree: dict[str, Any] = {}
    if preset:
        if preset not in PRESETS:
            raise ConfigError(f"config error: unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
        tree = merge(tree, PRESETS[preset])
    for f in files or []:
        tree = merge(tree, load_yaml(f))
    if extra:
        tree = merge(tree, extra)
    for item in overrides or []:
        tree = merge(tree, parse_override(item))
    train = tree.get("train")
    if isinstance(train, dict) and train.get("warmup_steps") == "preset":
        if not preset:
            raise ConfigError("config error: train.warmup_steps: 'preset' names a preset's fixed warm-up; "
                              "this config has no preset (give --preset, or a number of steps)")
        tree = merge(tree, {"train": {"warmup_steps": PRESET_WARMUP_STEPS[preset]}})
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    for key, value in tree.items():
        if key not in ("model", "data", "train"):
            raise ConfigError(f"config error: unknown key {str(key)!r}; allowed here: model, data, train")
        if not isinstance(value, dict):
            raise ConfigError(f"config error: {key}: expected a mapping, got {value!r}")
    return RunConfig(model=ModelConfig.from_dict(tree.get("model", {})),
                     data=build(DataConfig, tree.get("data", {}), "data"),
                     train=build(TrainConfig, tree.get("train", {}), "train")).validate()


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
