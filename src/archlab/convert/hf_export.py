"""Export an archlab checkpoint as a Hugging Face folder: the inverse of ``archlab.convert.hf``.

``archlab export-hf --ckpt RUN --out DIR`` writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and, when the run has one, ``tokenizer.json`` with a
``tokenizer_config.json`` (its eos/bos tokens and, when the checkpoint has one, its chat
template). Two kinds of folder, chosen by what the model computes (``plan_export``):

* **Llama**: a model a ``LlamaForCausalLM`` can hold is written as one, loaded by
  ``AutoModelForCausalLM.from_pretrained(DIR)`` without remote code and read by every tool that
  reads Llama folders (vLLM, llama.cpp's converter, lm-evaluation-harness's ``hf`` model; those
  are not tested here). The tensor mapping is ``archlab.convert.hf``'s table read right to left:
  ``wqkv`` splits into q/k/v, ``w_gate_up`` into gate/up, a tied head is written once. The check
  is a round trip: the exported ``config.json`` read back by the importer must describe the same
  function (every slot's kind but the initialisation, the sizes, RoPE, the norm, the tying).
  A delta-MHAR model whose residual parameters still equal their identity init *exactly* (right
  after ``archlab convert --to delta-mhar``) computes its baseline's function bit for bit, so it
  is written as that baseline (importing it back gives the baseline; converting again gives the
  same delta model).
* **remote code**: any other model is written with archlab's tensors unchanged (under
  ``model.``), its config resolved into plain numbers and the self-contained modeling file
  (``archlab.convert.hf_remote``): ``from_pretrained(DIR, trust_remote_code=True)``. An option that
  file does not implement is refused with one line naming it, before anything is written.

The special token ids are written into ``config.json`` and ``generation_config.json`` as ids or
null, never left out: transformers' Llama defaults (bos 1, eos 2) would stand in for them. The
output directory is written whole or not at all (a temporary folder, renamed).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from archlab.config import ModelConfig
from archlab.convert.hf import REMOTE_PREFIX, UnsupportedModel, config_from_hf
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


@dataclass
class ExportPlan:
    """What an export writes: ``config.json`` (without the special tokens) and the tensors."""

    kind: str  # "llama" or "remote"
    hf_config: dict[str, Any]
    tensors: dict[str, Tensor]
    note: str = ""  # said on the command line (the delta identity)


def delta_at_identity(model) -> tuple[bool, str]:
    """(whether every residual parameter of a delta-MHAR ``model`` still equals its identity
    init exactly, the first tensor that does not). Exactly, not within a tolerance: only then is
    the model the baseline's function, which a Llama folder computes."""
    from archlab.convert.delta import RESIDUAL_PREFIX, _delta_stream

    fresh = _delta_stream(model.cfg).state_dict()
    mine = model.residual.state_dict()
    for name, value in fresh.items():
        if name not in mine or not torch.equal(mine[name].detach().cpu().to(value.dtype), value):
            return False, RESIDUAL_PREFIX + name
    return True, ""


def plan_export(model) -> ExportPlan:
    """How ``model`` is exported: as ``LlamaForCausalLM`` when Llama computes its function (a
    delta-MHAR model at its exact identity included: its baseline's tensors are written), else
    through the remote-code modeling file (a trained delta-MHAR model too), else
    ``UnsupportedModel`` naming the option the modeling file lacks."""
    from archlab.convert.delta import RESIDUAL_PREFIX
    from archlab.convert.hf_remote import hf_config as remote_config
    from archlab.convert.hf_remote import unsupported
    from archlab.io.checkpoint import model_tensors

    cfg = model.cfg
    tensors = model_tensors(model)
    note = ""
    if registry.kind_of(cfg, "residual") == "delta":
        identity, moved = delta_at_identity(model)
        if identity:
            cfg = copy.deepcopy(cfg)
            cfg.residual = type(cfg.residual)()  # the standard stream, no routing options left
            cfg.validate()
            tensors = {k: v for k, v in tensors.items() if not k.startswith(RESIDUAL_PREFIX)}
            note = "delta-MHAR at its identity, exported as its baseline"
        else:
            note = f"delta-MHAR away from its identity ({moved}), exported with its routing"
    try:
        return ExportPlan("llama", hf_config_of(cfg), to_hf_state_dict(cfg, tensors), note)
    except UnsupportedModel:
        missing = unsupported(model)
        if missing is not None:
            raise UnsupportedModel(f"Hugging Face export does not support {missing}: a Llama model cannot hold "
                                   "it and archlab's remote-code modeling file does not implement it") from None
    tensors = model_tensors(model)  # the model's own tensors, the delta's routing included
    return ExportPlan("remote", remote_config(model, model.cfg.to_dict(full=True)),
                      {REMOTE_PREFIX + k: v.detach().contiguous() for k, v in tensors.items()}, note)


def export_hf(ckpt: str | Path, out: str | Path, notes: list[str] | None = None) -> Path:
    """Write checkpoint ``ckpt`` (a run directory or a checkpoint) as a Hugging Face folder ``out``;
    ``notes`` (when given) receives what the user should know about the choice made (a delta-MHAR
    model exported as its baseline, or with its routing)."""
    from safetensors.torch import save_file

    from archlab.convert.hf_remote import write_files
    from archlab.data.tokenizer import load_tokenizer
    from archlab.infer.loading import chat_template, special_tokens
    from archlab.io.checkpoint import load_model, remove_stale_temporaries

    out = Path(out)
    if out.exists():
        raise UsageError(f"--out {out} exists; export-hf writes a new folder and never overwrites one")
    model, run_cfg, path = load_model(ckpt, "cpu")
    model.eval()
    tok_file = path / "tokenizer.json"
    special = special_tokens(path, load_tokenizer(tok_file)) if tok_file.is_file() else {}
    template = chat_template(path)
    plan = plan_export(model)  # refuses before anything is written
    if notes is not None and plan.note:
        notes.append(plan.note)
    hf = {**plan.hf_config, **_special_ids(special)}
    # Built under the shared temporary naming (not a fixed ".NAME.partial"): two exports to one
    # name cannot delete each other's work, a killed export's leftover is removed by the next
    # writer in the folder, and a failed write is reported as the file of --out it was for.
    remove_stale_temporaries(out.parent)
    tmp = temporary_path(out, "tmp")
    tmp.mkdir(parents=True)
    try:
        _write_json(tmp / "config.json", hf)
        # transformers reads the ids generate stops on from here (LlamaConfig's defaults, bos 1
        # and eos 2, would otherwise stand in for a model that has other ids, or none)
        _write_json(tmp / "generation_config.json", {**_special_ids(special), "_from_model_config": True})
        with naming(tmp / "model.safetensors"):
            save_file({k: t.float() for k, t in plan.tensors.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt", "source": f"archlab checkpoint {path}"})
        if plan.kind == "remote":
            with naming(tmp / "modeling_archlab.py"):
                write_files(tmp)
        if tok_file.is_file():
            with naming(tmp / "tokenizer.json"):
                shutil.copyfile(tok_file, tmp / "tokenizer.json")
            tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": run_cfg.model.max_seq_len,
                       **{k: special[k] for k in ("eos_token", "bos_token") if special.get(k) is not None}}
            if template is not None:
                tok_cfg["chat_template"] = template
            _write_json(tmp / "tokenizer_config.json", tok_cfg)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _special_ids(special: dict[str, Any]) -> dict[str, Any]:
    """``bos_token_id``/``eos_token_id``, null where the model has none (written, not left out:
    a missing key would take transformers' defaults)."""
    return {"bos_token_id": special.get("bos_token_id"), "eos_token_id": special.get("eos_token_id")}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    with naming(path):
        path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def cli_export_hf(args) -> int:
    """``archlab export-hf --ckpt RUN --out DIR``."""
    notes: list[str] = []
    out = export_hf(args.ckpt, args.out, notes)
    cfg = json.loads((out / "config.json").read_text())
    tok = "with tokenizer.json" if (out / "tokenizer.json").is_file() else "without a tokenizer"
    if cfg["model_type"] == "llama":
        shape = (f"LlamaForCausalLM, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
                 f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads")
    else:
        shape = (f"ArchlabForCausalLM (remote code: load with trust_remote_code=True), "
                 f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}")
    print(f"exported {args.ckpt} -> {out}: {shape}, vocab {cfg['vocab_size']}, "
          f"tied={cfg.get('layout', {}).get('tie_embeddings', cfg['tie_word_embeddings'])} ({tok})"
          + "".join(f"; {n}" for n in notes))
    return 0
