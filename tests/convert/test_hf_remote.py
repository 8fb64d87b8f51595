"""Export through remote code: every option Llama cannot hold is written with archlab's modeling
file, which transformers loads with ``trust_remote_code`` and which computes archlab's logits
(fp32, within 1e-4) and greedy tokens; import-hf reads the folder back to the same tensors; the
file imports no archlab; an option it lacks is refused in one line."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from archlab.config import RunConfig  # noqa: E402
from archlab.convert.hf import UnsupportedModel, load_hf  # noqa: E402
from archlab.convert.hf_export import export_hf, plan_export  # noqa: E402
from archlab.convert.hf_remote import HERE, FILES  # noqa: E402
from archlab.infer.engine import Engine  # noqa: E402
from archlab.infer.sampling import SamplingParams  # noqa: E402
from archlab.io.checkpoint import model_tensors, save_model  # noqa: E402
from archlab.model import build_model  # noqa: E402
from archlab.model.config import ModelConfig  # noqa: E402
from tests.helpers import run_cli  # noqa: E402

VOCAB = 97


def tiny(**over) -> ModelConfig:
    tree = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48)
    tree.update(over)
    return ModelConfig.from_dict(tree).validate()


def checkpoint(tmp_path: Path, cfg: ModelConfig, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """A tiny model with every parameter perturbed (the zero-initialised coupling vectors, gates
    and routing queries too, so each one's use is tested) saved as an archlab checkpoint."""
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    run = RunConfig(model=cfg)
    run.train.seq_len = min(run.train.seq_len, cfg.max_seq_len)
    return save_model(tmp_path / "ckpt", model, run.validate()), model


def prediction(model, idx: torch.Tensor) -> torch.Tensor:
    """What archlab predicts: the logits, or the readout's log-probabilities with the decode
    branch (which the remote model returns as its logits)."""
    out = model(idx)
    return out.logits if out.extra_logits is None else model.log_probs(out)


OPTIONS = {
    "decode-branch-mixture": dict(branch={"enabled": True, "n_branches": 2}),
    "decode-branch-readout-branch": dict(branch={"enabled": True, "readout": "branch"}, ffn="triplu"),
    "attnres-full": dict(residual={"kind": "attnres"}),
    "attnres-block": dict(n_layers=3, residual={"kind": "attnres", "blocks": 2}),
    "mhar": dict(residual={"kind": "attnres", "heads": 4}),
    "delta-mhar-trained": dict(residual={"kind": "delta", "heads": 2, "delta_groups": 3}),
    "prism": dict(n_layers=3, n_heads=8, n_kv_heads=2, heads="prism", prism={"head_dims": [16, 8, 4]}),
    "layer-heads": dict(layer_heads=[2, 4]),
    "variable-width": dict(n_layers=4, width="variable", variable_width={"multiple_of": 16, "head_dim": 8}),
    "variable-width-attnres": dict(n_layers=4, width="variable", residual={"kind": "attnres", "heads": 2}),
    "layerrope": dict(norm="layerrope", tie_embeddings=True),
    "layerrope-learned-rotated-final": dict(norm="layerrope", layerrope={"learnable": True, "final": "rotated"}),
    "triplu": dict(ffn="triplu", triplu={"degree": 4}),
    "moe-shared": dict(ffn="moe", moe={"n_experts": 4, "top_k": 2, "shared_expert": True}),
    "looped-channel": dict(n_layers=3, tie_embeddings=True, schedule="looped",
                           looped={"prelude": 1, "loops": 2, "channel": "disco", "alpha_mode": "learned"}),
    "looped-attnres": dict(n_layers=3, schedule="looped", looped={"coda": 1, "loops": 3},
                           residual={"kind": "attnres", "blocks": 3}),
    "layer-dropout": dict(n_layers=3, schedule="layer_dropout"),
    "attn-sinks": dict(attn_sinks=True),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_remote_code_computes_archlabs_logits_and_greedy_tokens(tmp_path, name):
    ckpt, model = checkpoint(tmp_path, tiny(**OPTIONS[name]))
    out = export_hf(ckpt, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["ArchlabForCausalLM"] and set(FILES) <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "ArchlabForCausalLM"
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (prediction(model, idx) - hf(idx).logits).abs().max().item() < 1e-4
        prompt = idx[0, :7].tolist()
        theirs = hf.generate(idx[:1, :7], max_new_tokens=6, do_sample=False)[0, 7:].tolist()
    ours = Engine(model, slots=1).generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))[0].tokens
    assert theirs == list(ours)
    # import-hf reads the folder back to the very same tensors and config
    back = load_hf(out)
    assert back.config.to_dict(full=True) == model.cfg.to_dict(full=True)
    mine = model_tensors(model)
    assert set(back.state_dict) == set(mine) and all(torch.equal(back.state_dict[k], mine[k]) for k in mine)


@pytest.mark.parametrize("name", ["decode-branch-mixture", "attn-sinks", "delta-mhar-trained", "moe-shared",
                                  "looped-channel"])
def test_a_left_padded_batch_gets_each_sequences_own_logits_and_tokens(tmp_path, name):
    ckpt, model = checkpoint(tmp_path, tiny(**OPTIONS[name]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "hf"), trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    long, short = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    short = short[:7]
    batch = torch.stack([long, torch.cat([torch.zeros(5, dtype=torch.long), short])])  # short: 5 pads first
    mask = (torch.arange(12) >= torch.tensor([[0], [5]])).long()
    with torch.no_grad():
        logits = hf(batch, attention_mask=mask).logits
        assert (logits[0] - prediction(model, long[None])[0]).abs().max().item() < 1e-4
        assert (logits[1, 5:] - prediction(model, short[None])[0]).abs().max().item() < 1e-4
        together = hf.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        alone = hf.generate(short[None], max_new_tokens=4, do_sample=False)
    assert together[1, 12:].tolist() == alone[0, 7:].tolist()


def test_the_modeling_files_import_nothing_of_archlab():
    for name in FILES:
        tree = ast.parse((HERE / name).read_text())
        modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert modules and not [m for m in modules if m.startswith("archlab")], (name, modules)


def test_the_modeling_files_are_copied_verbatim(tmp_path):
    ckpt, _ = checkpoint(tmp_path, tiny(attn_sinks=True))
    out = export_hf(ckpt, tmp_path / "hf")
    for name in FILES:  # verbatim: the folder runs exactly the code archlab ships and tests
        assert (out / name).read_bytes() == (HERE / name).read_bytes()


def test_baseline_shaped_models_stay_llama(tmp_path):
    ckpt, _ = checkpoint(tmp_path, tiny(init="gamma"))
    out = export_hf(ckpt, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in cfg
    assert not any((out / name).exists() for name in FILES)


def test_an_option_the_file_lacks_is_refused_in_one_line(tmp_path, capsys):
    ckpt, model = checkpoint(tmp_path, tiny(ffn="moe", moe={"n_experts": 4, "top_k": 2},
                                            branch={"enabled": True}))
    with pytest.raises(UnsupportedModel) as e:
        plan_export(model)
    assert "decode branch with mixture-of-experts" in str(e.value) and "\n" not in str(e.value)
    code, out, err = run_cli(capsys, "export-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert code == 1 and err.count("\n") == 1 and "decode branch with mixture-of-experts" in err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


def test_cli_names_the_remote_code_kind_and_the_tokenizer_travels(tmp_path, capsys, stdlib_data):
    from archlab.data.tokenizer import load_tokenizer

    cfg = tiny(vocab_size=512, residual={"kind": "attnres"})
    torch.manual_seed(0)
    run = RunConfig(model=cfg)
    run.train.seq_len = min(run.train.seq_len, cfg.max_seq_len)
    ckpt = save_model(tmp_path / "ckpt", build_model(cfg), run.validate(), stdlib_data / "tokenizer.json")
    code, out, err = run_cli(capsys, "export-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert code == 0 and "ArchlabForCausalLM (remote code: load with trust_remote_code=True)" in out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    assert (hf.generation_config.eos_token_id, hf.config.eos_token_id, hf.config.bos_token_id) == (0, 0, None)
    text = "def parse(line):\n    return line.split()\n"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok(text)["input_ids"] == load_tokenizer(stdlib_data / "tokenizer.json").encode(text).ids
    code, out, err = run_cli(capsys, "import-hf", "--src", str(tmp_path / "hf"), "--out", str(tmp_path / "back"))
    assert code == 0 and "with tokenizer.json" in out
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
