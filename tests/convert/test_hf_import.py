"""Hugging Face Llama import: archlab's logits equal ``transformers``' (fp32) for random tiny models
(grouped-query attention, tied and untied heads, a head_dim that is not d_model / n_heads), through
the state dict, ``save_pretrained`` folders (single file and sharded), GGUF files and the CLI; and
everything archlab cannot represent is refused with one clear line."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from archlab.cli import main  # noqa: E402
from archlab.errors import ArchlabError, CheckpointError  # noqa: E402
from archlab.convert.hf import (UnsupportedModel, build_model_from_hf, config_from_hf,  # noqa: E402
                              from_hf_state_dict, load_hf)

VOCAB = 96
TOL = 1e-4


def hf_model(tie: bool = False, kv_heads: int = 2, head_dim: int | None = None, seed: int = 0):
    """A random tiny LlamaForCausalLM; every weight (norms included) perturbed away from its init so
    that a swapped or transposed tensor cannot go unnoticed."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=kv_heads, head_dim=head_dim, rope_theta=5000.0, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(seed))


def max_diff(archlab_model, hf) -> float:
    idx = tokens()
    with torch.no_grad():
        return float((archlab_model(idx).logits - hf(idx).logits).abs().max())


@pytest.mark.parametrize("tie,kv_heads,head_dim", [(False, 2, None), (True, 2, None), (False, 6, 12),
                                                   (True, 3, 16)])
def test_logits_match_transformers(tie, kv_heads, head_dim):
    hf = hf_model(tie, kv_heads, head_dim)
    cfg, sd = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    assert cfg.tie_embeddings == tie and cfg.kv_heads == kv_heads and cfg.n_layers == 3
    assert cfg.dim_per_head == (head_dim or 8) and cfg.rope_theta == 5000.0 and cfg.norm_eps == 1e-5
    assert ("lm_head.weight" in sd) == (not tie)
    model = build_model_from_hf(cfg, sd).eval()
    assert max_diff(model, hf) < TOL
    # the check has teeth: the same weights with q and k swapped inside wqkv (or the norms swapped) differ
    bad = copy.deepcopy(sd)
    bad["layers.0.attn_norm.weight"], bad["layers.0.mlp_norm.weight"] = (sd["layers.0.mlp_norm.weight"],
                                                                       sd["layers.0.attn_norm.weight"])
    assert max_diff(build_model_from_hf(cfg, bad).eval(), hf) > 1e-3


def test_rope_layout_is_not_permuted():
    """Interleaving q/k rows (the llama.cpp / Meta layout) would break the match: archlab uses HF's."""
    hf = hf_model()
    cfg, sd = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    hd, q_rows = cfg.dim_per_head, cfg.n_heads * cfg.dim_per_head
    w = sd["layers.0.attn.wqkv.weight"]
    q = w[:q_rows].view(cfg.n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(q_rows, -1)
    bad = dict(sd)
    bad["layers.0.attn.wqkv.weight"] = torch.cat([q, w[q_rows:]])
    assert max_diff(build_model_from_hf(cfg, sd).eval(), hf) < TOL
    assert max_diff(build_model_from_hf(cfg, bad).eval(), hf) > 1e-3


def save_tokenizer_json(folder: Path) -> Path:
    from archlab.data.tokenizer import train_bpe

    tok = train_bpe(["Namespaces are one honking great idea -- let's do more of those!"], 257)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("shard", [None, "30KB"])
def test_save_pretrained_folder_and_cli(tmp_path, capsys, shard):
    from archlab.io.checkpoint import load_model

    hf = hf_model(tie=shard is not None)
    src = tmp_path / "hf"
    hf.save_pretrained(src, **({"max_shard_size": shard} if shard else {}))
    assert (src / "model.safetensors.index.json").is_file() == (shard is not None)
    tok = save_tokenizer_json(src)
    loaded = load_hf(src)
    assert loaded.tokenizer is not None
    assert max_diff(build_model_from_hf(loaded.config, loaded.state_dict).eval(), hf) < TOL

    code = main(["import-hf", "--src", str(src), "--out", str(tmp_path / "ckpt")])
    out = capsys.readouterr().out
    assert code == 0 and "3 layers" in out and "with tokenizer.json" in out
    model, run_cfg, ckpt = load_model(tmp_path / "ckpt")
    assert max_diff(model.eval(), hf) < TOL
    assert (ckpt / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert run_cfg.model.max_seq_len == 64


# ---- GGUF through transformers ---------------------------------------------------------------------
def write_gguf(path: Path, hf) -> Path:
    """A float32 GGUF file of ``hf`` as llama.cpp's converter lays it out: q/k rows interleaved per
    head for its RoPE, and a byte-level BPE vocabulary."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    hd = c.hidden_size // c.num_attention_heads

    def interleave(w: torch.Tensor, heads: int) -> torch.Tensor:  # HF rotate-half rows -> llama.cpp pairs
        return w.view(heads, 2, hd // 2, -1).transpose(1, 2).reshape(w.shape)

    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(5000.0)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges([])
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[f"blk.{i}.attn_q.weight"] = interleave(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads)
        tensors[f"blk.{i}.attn_k.weight"] = interleave(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads)
        for hf_name, g_name in names.items():
            tensors[f"blk.{i}.{g_name}.weight"] = sd[p + hf_name + ".weight"]
    for name, t in tensors.items():
        w.add_tensor(name, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_import_matches(tmp_path, capsys, tie):
    from archlab.io.checkpoint import load_model

    hf = hf_model(tie=tie)
    path = write_gguf(tmp_path / "tiny.gguf", hf)
    loaded = load_hf(path)
    assert loaded.config.tie_embeddings == tie
    assert max_diff(build_model_from_hf(loaded.config, loaded.state_dict).eval(), hf) < TOL
    code = main(["import-hf", "--src", str(tmp_path), "--gguf", "tiny.gguf", "--out", str(tmp_path / "ckpt")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    model, _, ckpt = load_model(tmp_path / "ckpt")
    assert max_diff(model.eval(), hf) < TOL
    assert (ckpt / "tokenizer.json").is_file()


def test_gguf_without_transformers_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ArchlabError, match="needs the transformers package"):
        load_hf(tmp_path / "m.gguf")


# ---- refusals -----------------------------------------------------------------------------------------
def hf_cfg(**over):
    cfg = hf_model().config.to_dict()
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("over,words", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}, ["rope type 'linear'"]),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["rope_scaling", "'dynamic'"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["'llama3'"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"mlp_bias": True}, ["mlp_bias"]),
    ({"hidden_act": "gelu"}, ["hidden_act 'gelu'"]),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ["model_type 'gpt2'"]),
    ({"num_key_value_heads": 4}, ["n_kv_heads"]),
])
def test_unsupported_configs(over, words):
    with pytest.raises(UnsupportedModel) as e:
        config_from_hf(hf_cfg(**over))
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_bad_weights():
    hf = hf_model()
    cfg = hf.config.to_dict()
    sd = dict(hf.state_dict())
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match="missing model.layers.1.mlp.up_proj.weight"):
        from_hf_state_dict(missing, cfg)
    biased = dict(sd, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(48)})
    with pytest.raises(UnsupportedModel, match="biases.*q_proj.bias"):
        from_hf_state_dict(biased, cfg)
    with pytest.raises(UnsupportedModel, match="tensors archlab does not know: model.extra"):
        from_hf_state_dict(dict(sd, **{"model.extra": torch.zeros(1)}), cfg)
    wrong = dict(sd, **{"model.norm.weight": torch.ones(47)})
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \(47,\)"):
        from_hf_state_dict(wrong, cfg)
    untied = dict(cfg, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="missing lm_head.weight"):
        from_hf_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"}, untied)


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "SmolLM2.Q4_1.gguf").write_bytes(b"")
    cases = [
        (["--src", str(tmp_path / "nothing")], "does not exist"),
        (["--src", str(tmp_path)], "no config.json; it has SmolLM2.Q4_1.gguf: pass --gguf SmolLM2.Q4_1.gguf"),
        (["--src", str(tmp_path), "--gguf", "other.gguf"], "other.gguf does not exist"),
    ]
    for extra, words in cases:
        code = main(["import-hf", *extra, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 1 and len(err.strip().splitlines()) == 1 and words in err, err
        assert not (tmp_path / "out").exists()
    src = tmp_path / "hf"
    hf_model().save_pretrained(src)
    cfg = (src / "config.json").read_text().replace('"attention_bias": false', '"attention_bias": true')
    (src / "config.json").write_text(cfg)
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["import-hf", "--src", str(src), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and "attention_bias" in err and len(err.strip().splitlines()) == 1
