"""Export an archlab checkpoint as a Hugging Face Llama folder: the inverse of ``archlab.convert.hf``.

``archlab export-hf --ckpt RUN --out DIR`` writes ``config.json`` (``LlamaForCausalLM``),
``model.safetensors`` and, when the run has one, ``tokenizer.json`` with a ``tokenizer_config.json``
naming it: ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it and computes the
same logits (tested), and ``AutoTokenizer`` encodes as archlab does. It is the standard Llama
folder that other tools read (vLLM, llama.cpp's converter, lm-evaluation-harness's ``hf`` model);
those are not tested here. The tensor mapping is ``archlab.convert.hf``'s table read right to left:
``wqkv`` splits into q/k/v, ``w_gate_up`` into gate/up, a tied head is written once.

Only what a Llama model can hold is exported. The check is a round trip: the exported
``config.json`` read back by the importer must describe the same function (every slot's kind but
the initialisation, the sizes, RoPE, the norm, the tying); anything else (the decode branch,
attention residuals, MoE, the zoo options, attention sinks) is refused with one line that names
what differs. The output directory is written whole or not at all (a temporary folder, renamed).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from torch import Tensor

from archlab.config import ModelConfig
from archlab.convert.hf import UnsupportedModel, config_from_hf
from archlab.errors import UsageError
from archlab.io.files import naming
from archlab.io.temporaries import temporary_path
from archlab.model import registry


def hf_config_of(cfg: ModelConfig, eos_id: int | None = None) -> dict[str, Any]:
    """The ``LlamaConfig`` dict of ``cfg``, or ``UnsupportedModel`` when Llama cannot hold it."""
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "initializer_range": cfg.init_std, "torch_dtype": "float32",
    }
    if eos_id is not None:
        hf["eos_token_id"] = eos_id
    differs = sorted(k for k, (a, b) in _compare(cfg, config_from_hf(hf)).items() if a != b)
    if differs:
        mine = _function(cfg)
        raise UnsupportedModel("a Hugging Face Llama model cannot hold this model: it differs in "
                               + ", ".join(f"{k} ({mine[k]!r})" for k in differs))
    return hf


def _function(cfg: ModelConfig) -> dict[str, Any]:
    """What decides the function a config computes (not its initialisation)."""
    kinds = {f"model.{slot}": v.kind for slot, v in registry.chosen(cfg).items() if slot != "init"}
    core = {f.name for f in dataclasses.fields(cfg)}
    # every variant section with its values (defaults where unused), so only real differences show
    sections = {f"model.{name}.{k}": v for name, values in cfg.to_dict(full=True).items() if name not in core
                for k, v in (values.items() if isinstance(values, dict) else [("", values)])}
    return {
        **kinds, **sections, "model.attn_sinks": cfg.attn_sinks, "model.layer_heads": cfg.layer_heads,
        "model.vocab_size": cfg.vocab_size, "model.d_model": cfg.d_model, "model.n_layers": cfg.n_layers,
        "model.n_heads": cfg.n_heads, "model.n_kv_heads": cfg.kv_heads, "model.head_dim": cfg.dim_per_head,
        "model.ffn_hidden": cfg.hidden, "model.max_seq_len": cfg.max_seq_len, "model.rope_theta": cfg.rope_theta,
        "model.norm_eps": cfg.norm_eps, "model.tie_embeddings": cfg.tie_embeddings,
    }


def _compare(a: ModelConfig, b: ModelConfig) -> dict[str, tuple[Any, Any]]:
    fa, fb = _function(a), _function(b)
    return {k: (fa.get(k), fb.get(k)) for k in fa.keys() | fb.keys()}


def to_hf_state_dict(cfg: ModelConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """archlab baseline tensors (``model_tensors``: a tied head once) -> ``LlamaForCausalLM``'s."""
    q_dim, kv_dim = cfg.n_heads * cfg.dim_per_head, cfg.kv_heads * cfg.dim_per_head
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = sd[a + "attn.wqkv.weight"].split([q_dim, kv_dim, kv_dim], dim=0)
        gate, up = sd[a + "mlp.w_gate_up.weight"].split([cfg.hidden, cfg.hidden], dim=0)
        out.update({
            p + "input_layernorm.weight": sd[a + "attn_norm.weight"],
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": sd[a + "attn.wo.weight"],
            p + "post_attention_layernorm.weight": sd[a + "mlp_norm.weight"],
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": sd[a + "mlp.w_down.weight"],
        })
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return {k: t.detach().contiguous() for k, t in out.items()}


def export_hf(ckpt: str | Path, out: str | Path) -> Path:
    """Write checkpoint ``ckpt`` (a run directory or a checkpoint) as a Hugging Face folder ``out``."""
    from safetensors.torch import save_file

    from archlab.data.tokenizer import EOS_TOKEN, load_tokenizer
    from archlab.io.checkpoint import load_model, model_tensors, remove_stale_temporaries

    out = Path(out)
    if out.exists():
        raise UsageError(f"--out {out} exists; export-hf writes a new folder and never overwrites one")
    model, run_cfg, path = load_model(ckpt, "cpu")
    tok_file = path / "tokenizer.json"
    eos = load_tokenizer(tok_file).token_to_id(EOS_TOKEN) if tok_file.is_file() else None
    hf = hf_config_of(run_cfg.model, eos)  # refuses before anything is written
    tensors = to_hf_state_dict(run_cfg.model, model_tensors(model))
    # Built under the shared temporary naming (not a fixed ".NAME.partial"): two exports to one
    # name cannot delete each other's work, a killed export's leftover is removed by the next
    # writer in the folder, and a failed write is reported as the file of --out it was for.
    remove_stale_temporaries(out.parent)
    tmp = temporary_path(out, "tmp")
    tmp.mkdir(parents=True)
    try:
        with naming(tmp / "config.json"):
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        with naming(tmp / "model.safetensors"):
            save_file({k: t.float() for k, t in tensors.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt", "source": f"archlab checkpoint {path}"})
        if tok_file.is_file():
            with naming(tmp / "tokenizer.json"):
                shutil.copyfile(tok_file, tmp / "tokenizer.json")
            special = {"eos_token": EOS_TOKEN} if eos is not None else {}
            with naming(tmp / "tokenizer_config.json"):
                (tmp / "tokenizer_config.json").write_text(json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": run_cfg.model.max_seq_len,
                     **special}, indent=2) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cli_export_hf(args) -> int:
    """``archlab export-hf --ckpt RUN --out DIR``."""
    out = export_hf(args.ckpt, args.out)
    cfg = json.loads((out / "config.json").read_text())
    tok = "with tokenizer.json" if (out / "tokenizer.json").is_file() else "without a tokenizer"
    print(f"exported {args.ckpt} -> {out}: LlamaForCausalLM, {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}, {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads, vocab "
          f"{cfg['vocab_size']}, tied={cfg['tie_word_embeddings']} ({tok})")
    return 0
