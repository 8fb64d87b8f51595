"""Hugging Face export: a checkpoint written as a Llama folder that ``transformers`` loads with the
same logits (fp32), that import-hf reads back to the same weights, written whole or not at all;
an option a Llama model cannot hold goes through remote code (``test_hf_remote.py``); delta-MHAR
at its exact identity is its baseline's Llama; the tokenizer's special tokens, the eos/bos ids and
the chat template survive import -> export -> transformers."""

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
def test_what_llama_cannot_hold_goes_through_remote_code(tmp_path, over, named):
    ckpt, model = checkpoint(tmp_path, **over)
    with pytest.raises(UnsupportedModel) as e:
        hf_config_of(model.cfg)
    assert str(e.value).startswith("a Hugging Face Llama model cannot hold this model: it differs in ")
    assert named in str(e.value) and "\n" not in str(e.value)
    out = export_hf(ckpt, tmp_path / "hf")  # tests/convert/test_hf_remote.py checks what it computes
    assert json.loads((out / "config.json").read_text())["architectures"] == ["ArchlabForCausalLM"]


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


# ---- delta-MHAR: a Llama at its identity, remote code once trained ----------------------------------------
def delta_checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    from archlab.convert.delta import convert_checkpoint
    from archlab.io.checkpoint import load_model

    ckpt, _ = checkpoint(tmp_path)
    convert_checkpoint(ckpt, tmp_path / "delta", heads=2)
    model, _, path = load_model(tmp_path / "delta")
    return path, model.eval()


def test_delta_mhar_at_its_identity_exports_as_its_baseline_llama(tmp_path, capsys):
    ckpt, delta = delta_checkpoint(tmp_path)
    code, out, err = run_cli(capsys, "export-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert code == 0 and "LlamaForCausalLM" in out and "delta-MHAR at its identity, exported as its baseline" in out
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (delta(idx).logits - hf(idx).logits).abs().max().item() < 1e-4


def test_delta_mhar_moved_off_its_identity_keeps_its_routing(tmp_path):
    from archlab.convert.hf_export import plan_export
    from archlab.io.checkpoint import load_model

    ckpt, delta = delta_checkpoint(tmp_path)
    with torch.no_grad():
        delta.residual.gates[1] += 2.0 ** -20  # the smallest step away is enough: the check is exact
    plan = plan_export(delta)
    assert plan.kind == "remote" and "residual.gates" in plan.note
    with torch.no_grad():  # trained further, the routing now changes the function visibly
        delta.residual.gates[1] += 0.5
        delta.residual.queries[1].add_(0.5)
    _, run_cfg, _ = load_model(ckpt)
    out = export_hf(save_model(tmp_path / "moved", delta, run_cfg), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (delta(idx).logits - hf(idx).logits).abs().max().item() < 1e-4


# ---- special tokens and the chat template ----------------------------------------------------------------
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def smollm2_like_folder(folder: Path) -> Path:
    """A Hugging Face folder shaped like SmolLM2-Instruct's: a byte-level BPE whose first three
    tokens are <|endoftext|>, <|im_start|> (bos, id 1) and <|im_end|> (eos, id 2), a ChatML template,
    a tiny random Llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["What is two plus two? Four. Be brief, be kind."] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_special_tokens_and_chat_template_survive_import_and_export(tmp_path, capsys):
    from archlab.convert.hf import import_hf
    from archlab.infer.loading import chat_template, load_for_inference, special_tokens

    src = smollm2_like_folder(tmp_path / "smol")
    source = transformers.AutoTokenizer.from_pretrained(src)
    ckpt = import_hf(src, tmp_path / "ckpt")
    assert (ckpt / "chat_template.jinja").read_text() == CHAT_TEMPLATE == chat_template(ckpt)
    _, tok, eos, _ = load_for_inference(ckpt, "cpu", "float32")
    assert eos == 2 and special_tokens(ckpt, tok)["bos_token_id"] == 1

    code, out, err = run_cli(capsys, "export-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"))
    assert code == 0
    exported = tmp_path / "hf"
    cfg = json.loads((exported / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["bos_token_id"]) == (2, 1)
    generation = transformers.GenerationConfig.from_pretrained(exported)
    assert (generation.eos_token_id, generation.bos_token_id) == (2, 1)
    theirs = transformers.AutoTokenizer.from_pretrained(exported)
    assert (theirs.eos_token, theirs.eos_token_id, theirs.bos_token_id) == ("<|im_end|>", 2, 1)
    text = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == source.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and text.endswith("<|im_start|>assistant\n")
    ids = theirs.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 1 and ids.count(2) == 2  # the special tokens are single ids, not their spelling

    # and back again: the second import keeps the same tokens, template and weights
    again = import_hf(exported, tmp_path / "again")
    assert (again / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert json.loads((again / "state.json").read_text())["special_tokens"] == \
        {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    assert (again / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def test_a_checkpoint_without_special_tokens_keeps_archlabs_end_of_text(tmp_path, stdlib_data):
    ckpt, _ = checkpoint(tmp_path, stdlib_data / "tokenizer.json", vocab_size=512)
    out = export_hf(ckpt, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    # archlab trains with <|endoftext|> = 0 and no bos: null, not transformers' Llama default of 1
    assert cfg["eos_token_id"] == 0 and "bos_token_id" in cfg and cfg["bos_token_id"] is None
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
