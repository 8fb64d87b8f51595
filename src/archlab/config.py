"""Typed configuration: dataclasses, YAML files, ``--set key.sub=value`` overrides, presets.

Every config is a tree of dataclasses. Loading checks each key and value against the field's
annotation, so a typo or a bad value fails with one line naming the key and what is allowed
(``ConfigError``, exit code 2) before anything is written. Cross-field rules live in each
dataclass's ``validate``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from archlab.errors import ConfigError
from archlab.typed import build, check, merge, round_up


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
@dataclass
class ResidualConfig:
    """How a sublayer's input is formed from earlier outputs (spec section 2)."""

    kind: Literal["standard", "attnres", "delta"] = "standard"
    blocks: int = 0  # attnres: number of blocks over the 2L sublayers; 0 = full (one per sublayer)
    heads: int = 1  # attnres/delta: routing heads H (1 = AttnRes, >1 = MHAR)
    delta_groups: int = 0  # delta: groups of sublayers whose outputs form one delta source; 0 = L
    impl: Literal["auto", "reference", "compile", "triton"] = "auto"
    # dtype the depth sources are stored and routed in. auto: the autocast dtype when autocast is
    # on (bf16 on CUDA: the sublayer outputs are bf16 there anyway, so only the embedding source is
    # rounded, and the routing moves half the bytes), else the embedding's.
    source_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # dtype of the buffer in which the backward sums each source's gradient over its reads
    # (impl compile/triton). auto: the sources' dtype (the kernel adds in fp32 and rounds once per
    # read, as autograd's own bf16 sums did). float32, as the MHAR paper does, rounds the sum once
    # but made a 124m step take 28% longer on an H200 (docs/benchmarks.md).
    grad_dtype: Literal["auto", "float32", "bfloat16"] = "auto"


@dataclass
class MoEConfig:
    """Routed mixture-of-experts FFN (usable with or without the decode branch)."""

    n_experts: int = 8
    top_k: int = 2  # primary fan-out k1
    branch_top_k: int = 0  # branch fan-out k2 (0 = same as top_k)
    expert_hidden: int = 0  # 0 = the dense SwiGLU hidden size divided by top_k, multiple of 64
    shared_expert: bool = False
    aux_loss_coef: float = 0.01
    branch_routing: Literal["replay", "independent"] = "replay"


@dataclass
class BranchConfig:
    """Decode-Branch Transformer (spec section 1)."""

    enabled: bool = False
    n_branches: int = 1
    coupling: bool = True  # the a/b/c primary-to-branch coupling vectors
    readout: Literal["mixture", "branch"] = "mixture"
    detach_alpha: bool = False
    alpha_min: float = 0.5
    alpha_max: float = 1.0
    query_coupling: Literal["pre_rope", "post_rope"] = "pre_rope"  # uncertain in the paper


@dataclass
class ModelConfig:
    arch: Literal["llama"] = "llama"
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = n_heads (no grouping)
    head_dim: int = 0  # 0 = d_model // n_heads
    ffn: Literal["swiglu", "moe"] = "swiglu"
    ffn_hidden: int = 0  # 0 = 8/3 * d_model rounded up to a multiple of 64
    layer_heads: list[int] | None = None  # per-layer query-head schedule (head_dim = d/heads)
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    branch: BranchConfig = field(default_factory=BranchConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return _round_up(int(8 * self.d_model / 3), 64)

    def heads_at(self, layer: int) -> tuple[int, int, int]:
        """(query heads, kv heads, head dim) of one layer; a schedule keeps q-per-kv fixed."""
        if self.layer_heads is None:
            return self.n_heads, self.kv_heads, self.dim_per_head
        h = self.layer_heads[layer]
        group = self.n_heads // self.kv_heads
        return h, max(1, h // group), self.d_model // h

    def validate(self) -> None:
        _check(self.d_model > 0 and self.n_layers > 0 and self.vocab_size > 1, "model",
               "d_model, n_layers and vocab_size must be positive")
        _check(self.n_heads > 0, "model.n_heads", "must be positive")
        _check(self.n_heads % self.kv_heads == 0, "model.n_kv_heads",
               f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}")
        _check(self.dim_per_head % 2 == 0, "model.head_dim", "must be even for RoPE")
        if not self.head_dim:
            _check(self.d_model % self.n_heads == 0, "model.n_heads",
                   f"must divide d_model={self.d_model} (or set model.head_dim)")
        if self.layer_heads is not None:
            _check(len(self.layer_heads) == self.n_layers, "model.layer_heads",
                   f"needs one entry per layer ({self.n_layers}), got {len(self.layer_heads)}")
            group = self.n_heads // self.kv_heads
            for h in self.layer_heads:
                _check(h > 0 and self.d_model % h == 0 and (self.d_model // h) % 2 == 0,
                       "model.layer_heads", f"{h} heads must split d_model={self.d_model} into even head dims")
                _check(h % group == 0, "model.layer_heads",
                       f"{h} heads is not a multiple of the q-per-kv group {group}")
        _check(self.init_std > 0, "model.init_std", "must be positive")
        r = self.residual
        _check(r.heads > 0 and self.d_model % r.heads == 0, "model.residual.heads",
               f"must divide d_model={self.d_model}, got {r.heads}")
        _check(r.blocks >= 0 and r.blocks <= 2 * self.n_layers, "model.residual.blocks",
               f"must be in 0..{2 * self.n_layers} (0 = full AttnRes), got {r.blocks}")
        _check(r.delta_groups >= 0 and r.delta_groups <= 2 * self.n_layers, "model.residual.delta_groups",
               f"must be in 0..{2 * self.n_layers}, got {r.delta_groups}")
        b = self.branch
        _check(b.n_branches >= 1, "model.branch.n_branches", "must be >= 1")
        _check(0.0 <= b.alpha_min <= b.alpha_max <= 1.0, "model.branch.alpha_min",
               "need 0 <= alpha_min <= alpha_max <= 1")
        m = self.moe
        if self.ffn == "moe":
            _check(m.n_experts >= 1, "model.moe.n_experts", "must be >= 1")
            _check(1 <= m.top_k <= m.n_experts, "model.moe.top_k",
                   f"must be in 1..n_experts={m.n_experts}, got {m.top_k}")
            k2 = m.branch_top_k or m.top_k
            _check(1 <= k2 <= m.n_experts, "model.moe.branch_top_k",
                   f"must be in 0..n_experts={m.n_experts}, got {m.branch_top_k}")
            if b.enabled and m.branch_routing == "replay":
                _check(k2 <= m.top_k, "model.moe.branch_top_k",
                       f"router replay picks the branch's experts among the primary's {m.top_k}; "
                       f"branch_top_k={k2} needs moe.branch_routing=independent")


# --------------------------------------------------------------------------------------------
# Data and training
# --------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    path: str = "data/stdlib"  # a prepared data directory (archlab data prepare)
    seed: int = 0  # data-order seed, separate from the init seed


@dataclass
class TrainConfig:
    seed: int = 0  # initialisation seed
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_frac: float = 0.2  # wsd: fraction of steps in the final decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 100
    keep_ckpts: int = 2
    log_every: int = 10
    compile: bool = False
    # replay the whole step as one CUDA graph after a few warm-up steps (CUDA only; for models
    # whose step is host-bound, e.g. AttnRes's graph-broken routing reads; train/cuda_graph.py)
    cuda_graph: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    threads: int = 0  # CPU threads for torch (0 = torch's default)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum

    def validate(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum", "steps", "eval_every", "eval_batches",
                     "ckpt_every", "keep_ckpts", "log_every"):
            _check(getattr(self, name) > 0, f"train.{name}", "must be positive")
        _check(self.lr > 0, "train.lr", "must be positive")
        _check(0 <= self.warmup_steps <= self.steps, "train.warmup_steps",
               f"must be in 0..steps={self.steps}")
        _check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        _check(0 < self.decay_frac <= 1, "train.decay_frac", "must be in (0, 1]")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               "train.device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> "RunConfig":
        self.model.validate()
        self.train.validate()
        _check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
               f"must be <= model.max_seq_len={self.model.max_seq_len}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """A stable hash of everything that changes what a run computes."""
        blob = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Presets: tiny trains on a laptop CPU in minutes; the others are GPU sizes.
# --------------------------------------------------------------------------------------------
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {"vocab_size": 4096, "d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 256},
        "train": {"batch_size": 16, "seq_len": 128, "steps": 300, "lr": 3e-3, "warmup_steps": 30,
                  "eval_every": 100, "ckpt_every": 100},
    },
    "20m": {
        "model": {"vocab_size": 8192, "d_model": 384, "n_layers": 8, "n_heads": 6, "n_kv_heads": 6,
                  "max_seq_len": 1024},
        "train": {"batch_size": 32, "seq_len": 512, "steps": 4000, "lr": 1.5e-3, "warmup_steps": 200,
                  "eval_every": 250, "ckpt_every": 1000, "compile": True},
    },
    "124m": {
        "model": {"vocab_size": 50304, "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 12,
                  "max_seq_len": 1024},
        "train": {"batch_size": 32, "seq_len": 1024, "steps": 10000, "lr": 6e-4, "warmup_steps": 500,
                  "eval_every": 500, "ckpt_every": 2000, "compile": True},
    },
    "350m": {
        "model": {"vocab_size": 50304, "d_model": 1024, "n_layers": 24, "n_heads": 16, "n_kv_heads": 16,
                  "max_seq_len": 1024},
        "train": {"batch_size": 16, "seq_len": 1024, "grad_accum": 2, "steps": 20000, "lr": 3e-4,
                  "warmup_steps": 1000, "eval_every": 1000, "ckpt_every": 2000, "compile": True},
    },
    "1b": {
        "model": {"vocab_size": 50304, "d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                  "max_seq_len": 2048},
        "train": {"batch_size": 8, "seq_len": 2048, "grad_accum": 4, "steps": 30000, "lr": 3e-4,
                  "warmup_steps": 2000, "eval_every": 1000, "ckpt_every": 2000, "compile": True},
    },
}


# --------------------------------------------------------------------------------------------
# Loading and overriding
# --------------------------------------------------------------------------------------------
_round_up = round_up
_check = check
_build = build
_merge = merge


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


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config error: config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError(f"config error: {p} is not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config error: {p} must hold a mapping at the top level")
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
        tree = _merge(tree, PRESETS[preset])
    for f in files or []:
        tree = _merge(tree, load_yaml(f))
    if extra:
        tree = _merge(tree, extra)
    for item in overrides or []:
        tree = _merge(tree, parse_override(item))
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, tree).validate()


def model_config_from_dict(tree: dict[str, Any]) -> ModelConfig:
    cfg = _build(ModelConfig, tree, "model")
    cfg.validate()
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
