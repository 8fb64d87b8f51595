"""Import Hugging Face Llama-architecture checkpoints into archlab's baseline model.

``from_hf_state_dict(state_dict, hf_config)`` maps a ``LlamaForCausalLM`` state dict and its
``config.json`` dict to ``(ModelConfig, archlab state dict)``:

=====================================================  ==========================================
Hugging Face                                           archlab
=====================================================  ==========================================
model.embed_tokens.weight                              tok_emb.weight
model.layers.i.input_layernorm.weight                  layers.i.attn_norm.weight
model.layers.i.self_attn.{q,k,v}_proj.weight           layers.i.attn.wqkv.weight = cat([q; k; v])
model.layers.i.self_attn.o_proj.weight                 layers.i.attn.wo.weight
model.layers.i.post_attention_layernorm.weight         layers.i.mlp_norm.weight
model.layers.i.mlp.{gate,up}_proj.weight               layers.i.mlp.w_gate_up.weight = cat([gate; up])
model.layers.i.mlp.down_proj.weight                    layers.i.mlp.w_down.weight
model.norm.weight                                      norm.weight
lm_head.weight (absent or ignored when tied)           lm_head.weight (tied: shares tok_emb.weight)
=====================================================  ==========================================

hidden_size -> d_model, num_hidden_layers -> n_layers, num_attention_heads -> n_heads,
num_key_value_heads -> n_kv_heads, head_dim -> head_dim, intermediate_size -> ffn_hidden,
vocab_size, max_position_embeddings -> max_seq_len, rope_theta (or ``rope_parameters.rope_theta``)
-> rope_theta, rms_norm_eps -> norm_eps, tie_word_embeddings -> tie_embeddings.

RoPE: Hugging Face Llama checkpoints store q/k projections in the "rotate half" layout (the
conversion from Meta's interleaved weights permutes the rows once), with
``inv_freq = theta^(-2i/d)``: exactly archlab's ``apply_rope``, so q/k rows are copied unpermuted.
GGUF files store q/k permuted for llama.cpp; ``transformers`` undoes that when it loads them.

Refused with a clear error: other architectures, RoPE scaling (linear, dynamic, yarn, llama3, ...),
attention or MLP biases, activations other than SiLU, unknown or missing tensors.

The returned state dict has tied tensors once (``tok_emb.weight`` only), like archlab checkpoints;
``build_model_from_hf`` gives a ready model. ``load_hf(path)`` reads a folder with ``config.json``
and ``model.safetensors`` (or a sharded ``model.safetensors.index.json``), or a GGUF file through
``transformers`` (``pip install transformers gguf accelerate``), with its ``tokenizer.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from archlab.config import ModelConfig
from archlab.errors import ArchlabError, CheckpointError, DataError

_HF_LAYER = "model.layers.{i}."
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class UnsupportedModel(ArchlabError):
    """A Hugging Face model that archlab's baseline cannot represent exactly."""


@dataclass
class HFModel:
    config: ModelConfig
    state_dict: dict[str, Tensor]
    tokenizer: Any | None  # a tokenizers.Tokenizer, when the source has one
    hf_config: dict[str, Any]
    source: str


def _get(cfg: dict[str, Any], key: str, default: Any = None, required: bool = True) -> Any:
    v = cfg.get(key, default)
    if v is None and required:
        raise UnsupportedModel(f"Hugging Face config: missing {key!r}")
    return v


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for where, d in (("rope_scaling", scaling), ("rope_parameters", params)):
        kind = d.get("rope_type", d.get("type", "default"))
        if kind not in ("default", None):
            raise UnsupportedModel(f"Hugging Face config: {where} uses rope type {kind!r}; archlab's baseline "
                                   "supports plain RoPE only (no scaling)")
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """archlab ``ModelConfig`` of a Hugging Face ``LlamaConfig`` dict (refusing what it cannot hold)."""
    mtype = hf.get("model_type")
    archs = hf.get("architectures") or []
    if mtype != "llama" and "LlamaForCausalLM" not in archs:
        raise UnsupportedModel(f"Hugging Face config: model_type {mtype!r} is not a Llama architecture")
    if hf.get("attention_bias"):
        raise UnsupportedModel("Hugging Face config: attention_bias=true; archlab's attention has no biases")
    if hf.get("mlp_bias"):
        raise UnsupportedModel("Hugging Face config: mlp_bias=true; archlab's MLP has no biases")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"Hugging Face config: hidden_act {act!r}; archlab's SwiGLU uses silu")
    d = int(_get(hf, "hidden_size"))
    n_heads = int(_get(hf, "num_attention_heads"))
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or d // n_heads)
    cfg = ModelConfig(
        vocab_size=int(_get(hf, "vocab_size")), d_model=d, n_layers=int(_get(hf, "num_hidden_layers")),
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=0 if head_dim * n_heads == d else head_dim,
        ffn="swiglu", ffn_hidden=int(_get(hf, "intermediate_size")),
        max_seq_len=int(hf.get("max_position_embeddings") or 2048), rope_theta=_rope_theta(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    try:
        cfg.validate()
    except ArchlabError as e:
        raise UnsupportedModel(f"Hugging Face config does not map to a valid archlab model: {e}") from None
    if cfg.dim_per_head != head_dim:
        raise UnsupportedModel(f"Hugging Face config: head_dim {head_dim} does not fit hidden_size {d}")
    return cfg


def from_hf_state_dict(state_dict: dict[str, Tensor], hf_config: dict[str, Any],
                       dtype: torch.dtype | None = torch.float32) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``(ModelConfig, archlab state dict)`` of a ``LlamaForCausalLM`` state dict.

    ``dtype``: cast every tensor (default float32; ``None`` keeps the source dtype).
    """
    cfg = config_from_hf(hf_config)
    sd = {k: v for k, v in state_dict.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if "tie_word_embeddings" not in hf_config and "lm_head.weight" not in sd:
        cfg.tie_embeddings = True  # an old config without the key, and no separate head: tied
    used: set[str] = set()

    def take(key: str) -> Tensor:
        if key not in sd:
            raise CheckpointError(f"Hugging Face weights: missing {key}")
        used.add(key)
        t = sd[key]
        return t.to(dtype) if dtype is not None else t

    def shaped(t: Tensor, key: str, shape: tuple[int, ...]) -> Tensor:
        if tuple(t.shape) != shape:
            raise CheckpointError(f"Hugging Face weights: {key} has shape {tuple(t.shape)}, the config "
                                  f"implies {shape}")
        return t

    d, hd, v = cfg.d_model, cfg.dim_per_head, cfg.vocab_size
    q_dim, kv_dim = cfg.n_heads * hd, cfg.kv_heads * hd
    out: dict[str, Tensor] = {}
    out["tok_emb.weight"] = shaped(take("model.embed_tokens.weight"), "model.embed_tokens.weight", (v, d))
    for i in range(cfg.n_layers):
        p = _HF_LAYER.format(i=i)
        q = shaped(take(p + "self_attn.q_proj.weight"), p + "self_attn.q_proj.weight", (q_dim, d))
        k = shaped(take(p + "self_attn.k_proj.weight"), p + "self_attn.k_proj.weight", (kv_dim, d))
        vv = shaped(take(p + "self_attn.v_proj.weight"), p + "self_attn.v_proj.weight", (kv_dim, d))
        out[f"layers.{i}.attn_norm.weight"] = shaped(take(p + "input_layernorm.weight"),
                                                     p + "input_layernorm.weight", (d,))
        out[f"layers.{i}.attn.wqkv.weight"] = torch.cat([q, k, vv], dim=0)
        out[f"layers.{i}.attn.wo.weight"] = shaped(take(p + "self_attn.o_proj.weight"),
                                                   p + "self_attn.o_proj.weight", (d, q_dim))
        out[f"layers.{i}.mlp_norm.weight"] = shaped(take(p + "post_attention_layernorm.weight"),
                                                    p + "post_attention_layernorm.weight", (d,))
        gate = shaped(take(p + "mlp.gate_proj.weight"), p + "mlp.gate_proj.weight", (cfg.hidden, d))
        up = shaped(take(p + "mlp.up_proj.weight"), p + "mlp.up_proj.weight", (cfg.hidden, d))
        out[f"layers.{i}.mlp.w_gate_up.weight"] = torch.cat([gate, up], dim=0)
        out[f"layers.{i}.mlp.w_down.weight"] = shaped(take(p + "mlp.down_proj.weight"),
                                                      p + "mlp.down_proj.weight", (d, cfg.hidden))
    out["norm.weight"] = shaped(take("model.norm.weight"), "model.norm.weight", (d,))
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # a tied head may be listed too; it is the embedding
    else:
        out["lm_head.weight"] = shaped(take("lm_head.weight"), "lm_head.weight", (v, d))
    stray = sorted(set(sd) - used)
    if stray:
        bias = [k for k in stray if k.endswith(".bias")]
        what = "biases, which archlab's baseline does not have" if bias else "tensors archlab does not know"
        raise UnsupportedModel(f"Hugging Face weights hold {what}: {', '.join((bias or stray)[:3])}"
                               + (" ..." if len(bias or stray) > 3 else ""))
    return cfg, out


def build_model_from_hf(cfg: ModelConfig, state_dict: dict[str, Tensor]):
    """An archlab ``Transformer`` holding the imported weights (strict key and shape check)."""
    from archlab.model import build_model
    from archlab.io.checkpoint import load_weights

    model = build_model(cfg)
    load_weights(model, state_dict, Path("<hugging face import>"))
    return model


# ---- reading checkpoints ---------------------------------------------------------------------------
def _read_safetensors(folder: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable or has no 'weight_map' ({e.__class__.__name__})") from None
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} holds no model.safetensors (or index); only safetensors "
                                  "checkpoints are read (or pass a GGUF file)")
    sd: dict[str, Tensor] = {}
    for name in files:
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"{folder}: shard {name} named by the index is missing")
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
    return sd


def _tokenizer_file(path: Path):
    from tokenizers import Tokenizer

    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception
        raise DataError(f"{path} is not a valid tokenizers JSON file: {e}") from None


def _need_transformers(what: str):
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ArchlabError(f"{what} needs the transformers package (pip install transformers gguf accelerate)") \
            from None
    return transformers


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _load_gguf(folder: Path, gguf_file: str, dtype: torch.dtype | None) -> HFModel:
    import importlib.util

    if not (folder / gguf_file).is_file():
        raise CheckpointError(f"GGUF file {folder / gguf_file} does not exist")
    transformers = _need_transformers("loading a GGUF file")
    if importlib.util.find_spec("gguf") is None:
        raise ArchlabError("loading a GGUF file needs the gguf package (pip install gguf accelerate)")
    # ``dtype`` is the keyword from transformers 4.56 on, ``torch_dtype`` before
    key = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=gguf_file, local_files_only=True, **{key: torch.float32})
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"transformers cannot load {folder / gguf_file}: {str(e).splitlines()[0]}") from None
    hf_cfg = hf.config.to_dict()
    cfg, sd = from_hf_state_dict(hf.state_dict(), hf_cfg, dtype)
    tok = None
    try:
        fast = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file, local_files_only=True)
        tok = getattr(fast, "backend_tokenizer", None)
    except (ValueError, OSError, KeyError, TypeError) as e:  # weights without a usable tokenizer still import
        print(f"archlab: warning: no tokenizer from {gguf_file} ({e.__class__.__name__}: {e})", file=sys.stderr)
    return HFModel(cfg, sd, tok, hf_cfg, str(folder / gguf_file))


def load_hf(path: str | Path, gguf_file: str | None = None, dtype: torch.dtype | None = torch.float32) -> HFModel:
    """A Hugging Face Llama checkpoint as an ``HFModel`` (archlab config, state dict, tokenizer).

    ``path``: a folder with ``config.json`` + safetensors (single file or sharded index) and
    optionally ``tokenizer.json``; or a ``.gguf`` file; or a folder plus ``gguf_file`` (its name).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise CheckpointError(f"{p} is a file but not a .gguf; pass the checkpoint folder")
        return _load_gguf(p.parent, p.name, dtype)
    if gguf_file is not None:
        g = Path(gguf_file)
        if g.parent != Path(".") and g.is_file():  # a path to the file rather than a name in ``path``
            return _load_gguf(g.parent, g.name, dtype)
        return _load_gguf(p, gguf_file, dtype)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        ggufs = sorted(x.name for x in p.glob("*.gguf"))
        hint = f"; it has {ggufs[0]}: pass --gguf {ggufs[0]}" if ggufs else ""
        raise CheckpointError(f"{p} has no config.json{hint}")
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_path} is not readable JSON ({e.__class__.__name__})") from None
    if not isinstance(hf_cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    config_from_hf(hf_cfg)  # refuse unsupported models before reading gigabytes of weights
    cfg, sd = from_hf_state_dict(_read_safetensors(p), hf_cfg, dtype)
    return HFModel(cfg, sd, _tokenizer_file(p / "tokenizer.json"), hf_cfg, str(p))


def import_hf(src: str | Path, out: str | Path, gguf_file: str | None = None) -> Path:
    """Convert a Hugging Face checkpoint into an archlab checkpoint directory (``save_model``)."""
    from archlab.config import RunConfig
    from archlab.io.checkpoint import save_model

    hf = load_hf(src, gguf_file)
    model = build_model_from_hf(hf.config, hf.state_dict)
    run_cfg = RunConfig(model=hf.config)
    run_cfg.train.seq_len = min(run_cfg.train.seq_len, hf.config.max_seq_len)
    run_cfg.validate()
    extra = {"imported_from": {"source": hf.source, "format": "gguf" if hf.source.endswith(".gguf") else "hf",
                               "hf_config": _jsonable(hf.hf_config)}}
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = None
        if hf.tokenizer is not None:
            tok_path = Path(tmp) / "tokenizer.json"
            hf.tokenizer.save(str(tok_path))
        return save_model(out, model, run_cfg, tok_path, extra_state=extra)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))



def cli_import_hf(args) -> int:
    """``archlab import-hf --src PATH [--gguf FILE] --out DIR``."""
    ckpt = import_hf(args.src, args.out, args.gguf)
    from archlab.io.checkpoint import read_state

    state = read_state(ckpt)
    m = state["config"]["model"]
    tok = "with tokenizer.json" if "tokenizer.json" in state["files"] else "without a tokenizer"
    print(f"imported {args.src}{' / ' + args.gguf if args.gguf else ''}: {m['n_layers']} layers, "
          f"d_model {m['d_model']}, {m['n_heads']}/{m['n_kv_heads'] or m['n_heads']} heads, "
          f"vocab {m['vocab_size']}, tied={m['tie_embeddings']} -> {ckpt} ({tok})")
    return 0
