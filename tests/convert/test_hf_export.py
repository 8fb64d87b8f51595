"""Hugging Face export: a checkpoint written as a Llama folder that ``transformers`` loads with the
same logits (fp32), that import-hf reads back to the same weights, written whole or not at all;
every option a Llama model cannot hold is refused with one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from archlab.config import RunConfig  # noqa: E402
from archlab.convert.hf import UnsupportedModel, load_hf  # noqa: E402
from archlab.convert.hf_export import export_hf, hf_config_of  # noqa: E402
from archlab.errors import ArchlabError  # noqa: E402
from archlab.io.checkpoint import save_model  # noqa: E402
from archlab.model import build_model  # noqa: E402
from tests.helpers import run_cli, tiny_model_cfg  # noqa: E402


def checkpoint(tmp_path: Path, tokenizer: Path | None = None, **over) -> tuple[Path, torch.nn.Module]:
    """A random tiny model (every weight perturbed, norms included, so a swap cannot hide) saved as
    an archlab checkpoint."""
    torch.manual_seed(0)
    cfg = tiny_model_cfg(**over)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    run = RunConfig(model=cfg)
    run.train.seq_len = min(run.train.seq_len, cfg.max_seq_len)
    return save_model(tmp_path / "ckpt", model, run.validate(), tokenizer), model


@pytest.mark.parametrize("over", [{}, {"tie_embeddings": True}, {"n_kv_heads": 4, "head_dim": 12},
                                  {"n_kv_heads": 1, "ffn_hidden": 80, "rope_theta": 5000.0}])
def test_transformers_computes_the_same_logits(tmp_path, over):
    ckpt, model = checkpoint(tmp_path, **over)
    out = export_hf(ckpt, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    idx = torch.randint(0, 97, (3, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(idx).logits - hf(idx).logits).abs().max().item()
    assert diff < 1e-4
    # import-hf reads the folder back to the very same tensors
    back = load_hf(out)
    mine = {k: v for k, v in model.state_dict().items() if not (model.cfg.tie_embeddings and k == "lm_head.weight")}
    assert set(back.state_dict) == set(mine)
    assert all(torch.equal(back.state_dict[k], mine[k]) for k in mine)


def test_the_tokenizer_travels_and_transformers_reads_it(tmp_path, stdlib_data):
    ckpt, _ = checkpoint(tmp_path, stdlib_data / "tokenizer.json", vocab_size=512)
    out = export_hf(ckpt, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    from archlab.data.tokenizer import load_tokenizer

    ours = load_tokenizer(stdlib_data / "tokenizer.json")
    text = "def parse(line):\n    return line.split()\n"
    assert tok(text)["input_ids"] == ours.encode(text).ids
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.eos_token_id is not None


@pytest.mark.parametrize("over, named", [
    ({"attn_sinks": True}, "model.attn_sinks (True)"),
    ({"ffn": "triplu"}, "model.ffn ('triplu')"),
    ({"norm": "layerrope"}, "model.norm ('layerrope')"),
])
def test_what_llama_cannot_hold_is_refused_before_writing(tmp_path, over, named):
    ckpt, _ = checkpoint(tmp_path, **over)
    with pytest.raises(UnsupportedModel) as e:
        export_hf(ckpt, tmp_path / "hf")
    assert str(e.value).startswith("a Hugging Face Llama model cannot hold this model: it differs in ")
    assert named in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


def test_branch_and_attnres_are_refused_by_the_round_trip():
    for section, key, value, word in (("branch", "enabled", True, "model.rows ('branch')"),
                                      ("residual", "kind", "attnres", "model.residual ('attnres')")):
        cfg = tiny_model_cfg()
        setattr(getattr(cfg, section), key, value)
        cfg.validate()
        with pytest.raises(UnsupportedModel, match=word.replace("(", r"\(").replace(")", r"\)")):
            hf_config_of(cfg)


def test_cli_writes_a_new_folder_only(tmp_path, capsys):
    ckpt, _ = checkpoint(tmp_path)
    code, out, err = run_cli(capsys, "export-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert code == 0 and "LlamaForCausalLM, 2 layers" in out
    before = (tmp_path / "hf" / "model.safetensors").read_bytes()
    code, out, err = run_cli(capsys, "export-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert code == 2 and err.count("\n") == 1 and "never overwrites" in err
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == before
    code, out, err = run_cli(capsys, "export-hf", "--ckpt", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"))
    assert code == 1 and err.count("\n") == 1 and "does not exist" in err
    with pytest.raises(ArchlabError):
        export_hf(ckpt, tmp_path / "hf")
