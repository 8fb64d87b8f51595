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
A folder ``archlab export-hf`` wrote through remote code (``model_type: archlab``) holds archlab's
own config (``archlab_model``) and tensors (under ``model.``): it is read back as they are.

Metadata (``special_tokens_of``): the eos/bos tokens and the chat template travel with the
tokenizer. ``import_hf`` records the tokens as strings in ``state.json`` (``special_tokens``) and
the template as ``chat_template.jinja`` beside ``tokenizer.json``; ``archlab.infer.loading`` reads
both (docs/huggingface.md).
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, field
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
    #: ``eos_token``/``bos_token`` strings (or None), what archlab's checkpoint records
    #: (``archlab.infer.loading.special_tokens`` reads them back as ids of the tokenizer)
    special_tokens: dict[str, str | None] = field(default_factory=dict)
    chat_template: str | None = None


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


# ---- special tokens and the chat template -------------------------------------------------------------
def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken mapping."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value: Any) -> int | None:
    """A token id as configs write it: an int or a list of ids (the first is the one kept)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _template_text(value: Any) -> str | None:
    """A chat template as ``tokenizer_config.json`` writes it: a string, or named templates of
    which archlab keeps ``default`` (else the first): the server applies one template."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    return value if isinstance(value, str) else None


def special_tokens_of(tokenizer: Any, tokenizer_config: dict[str, Any], *configs: dict[str, Any]) -> dict[str, Any]:
    """``eos_token``/``bos_token`` of a source model as strings of ``tokenizer`` (None when it has
    none, or no tokenizer). The ids in ``configs`` win (``generation_config.json``, then
    ``config.json``): they are what ``generate`` stops on, and a chat model's end of turn is often
    not the tokenizer's ``eos_token`` string; but only an id of an added (special) token counts,
    since a config written with transformers' Llama defaults names ids 1 and 2 whatever they are.
    Then ``tokenizer_config.json``'s strings. A token the tokenizer does not hold is dropped."""
    out: dict[str, Any] = {}
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()} if tokenizer is not None else set()
    for name in ("eos", "bos"):
        text = None
        for cfg in configs:
            i = _first_id(cfg.get(f"{name}_token_id"))
            token = tokenizer.id_to_token(i) if i is not None and i >= 0 and tokenizer is not None else None
            if token in added:
                text = token
                break
        if text is None:
            text = _token_text(tokenizer_config.get(f"{name}_token"))
        if text is not None and (tokenizer is None or tokenizer.token_to_id(text) is None):
            text = None
        out[f"{name}_token"] = text
    return out


def _optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e.__class__.__name__})") from None
    return value if isinstance(value, dict) else {}


def _folder_metadata(folder: Path, tokenizer: Any, hf_cfg: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(special tokens, chat template) of a Hugging Face folder: ``chat_template.jinja`` (where
    transformers 4.50+ saves it) or ``tokenizer_config.json``'s ``chat_template``."""
    tok_cfg = _optional_json(folder / "tokenizer_config.json")
    generation = _optional_json(folder / "generation_config.json")
    jinja = folder / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else _template_text(tok_cfg.get("chat_template"))
    return special_tokens_of(tokenizer, tok_cfg, generation, hf_cfg), template


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
    tok, tok_cfg, template = None, {}, None
    try:
        fast = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file, local_files_only=True)
        tok = getattr(fast, "backend_tokenizer", None)
        tok_cfg = {"eos_token": fast.eos_token, "bos_token": fast.bos_token}
        template = _template_text(getattr(fast, "chat_template", None))
    except (ValueError, OSError, KeyError, TypeError) as e:  # weights without a usable tokenizer still import
        print(f"archlab: warning: no tokenizer from {gguf_file} ({e.__class__.__name__}: {e})", file=sys.stderr)
    generation = hf.generation_config.to_dict() if getattr(hf, "generation_config", None) is not None else {}
    return HFModel(cfg, sd, tok, hf_cfg, str(folder / gguf_file), special_tokens_of(tok, tok_cfg, generation, hf_cfg),
                   template)


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
    if hf_cfg.get("model_type") == REMOTE_MODEL_TYPE:
        cfg = _remote_config(hf_cfg, cfg_path)
        sd = _remote_state_dict(_read_safetensors(p), p, dtype)
    else:
        config_from_hf(hf_cfg)  # refuse unsupported models before reading gigabytes of weights
        cfg, sd = from_hf_state_dict(_read_safetensors(p), hf_cfg, dtype)
    tokenizer = _tokenizer_file(p / "tokenizer.json")
    special, template = _folder_metadata(p, tokenizer, hf_cfg)
    return HFModel(cfg, sd, tokenizer, hf_cfg, str(p), special, template)


# ---- archlab's own remote-code exports (``archlab.convert.hf_remote``) --------------------------------
REMOTE_MODEL_TYPE = "archlab"
REMOTE_PREFIX = "model."


def _remote_config(hf_cfg: dict[str, Any], where: Path) -> ModelConfig:
    """The archlab config an ``export-hf`` remote-code folder keeps under ``archlab_model``."""
    tree = hf_cfg.get("archlab_model")
    if not isinstance(tree, dict):
        raise CheckpointError(f"{where}: model_type 'archlab' without an 'archlab_model' mapping; "
                              "not a folder written by archlab export-hf")
    try:
        return ModelConfig.from_dict(tree).validate()
    except ArchlabError as e:
        raise CheckpointError(f"{where}: its archlab_model is not a valid archlab model config: {e}") from None


def _remote_state_dict(sd: dict[str, Tensor], where: Path, dtype: torch.dtype | None) -> dict[str, Tensor]:
    """archlab's tensors, which a remote-code export stores unchanged under ``model.``."""
    stray = sorted(k for k in sd if not k.startswith(REMOTE_PREFIX))
    if stray:
        raise CheckpointError(f"{where}: tensor {stray[0]} is not under {REMOTE_PREFIX!r}; not a folder written by "
                              "archlab export-hf")
    return {k[len(REMOTE_PREFIX):]: (v.to(dtype) if dtype is not None else v) for k, v in sd.items()}


def import_hf(src: str | Path, out: str | Path, gguf_file: str | None = None) -> Path:
    """Convert a Hugging Face checkpoint (or an archlab remote-code export) into an archlab checkpoint
    directory, with its tokenizer, special tokens and chat template."""
    from archlab.config import RunConfig
    from archlab.infer.loading import CHAT_TEMPLATE_FILE
    from archlab.io.checkpoint import model_tensors, write_checkpoint

    hf = load_hf(src, gguf_file)
    model = build_model_from_hf(hf.config, hf.state_dict)
    run_cfg = RunConfig(model=hf.config)
    run_cfg.train.seq_len = min(run_cfg.train.seq_len, hf.config.max_seq_len)
    run_cfg.validate()
    state = {"config": run_cfg.to_dict(), "config_hash": run_cfg.hash(),
             "imported_from": {"source": hf.source, "format": "gguf" if hf.source.endswith(".gguf") else "hf",
                               "hf_config": _jsonable(hf.hf_config)}}
    if hf.tokenizer is not None:  # a token not found is left out: the reader's default stands
        state["special_tokens"] = {k: v for k in ("eos_token", "bos_token")
                                   if (v := hf.special_tokens.get(k)) is not None}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        if hf.tokenizer is not None:
            files["tokenizer.json"] = Path(tmp) / "tokenizer.json"
            hf.tokenizer.save(str(files["tokenizer.json"]))
        if hf.chat_template is not None:
            # beside tokenizer.json, where ``archlab serve`` reads it (``infer.loading.chat_template``)
            files[CHAT_TEMPLATE_FILE] = Path(tmp) / CHAT_TEMPLATE_FILE
            files[CHAT_TEMPLATE_FILE].write_text(hf.chat_template, encoding="utf-8")
        return write_checkpoint(Path(out), {"model": model_tensors(model)}, state, files or None)


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
