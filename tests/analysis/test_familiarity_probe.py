"""``archlab probe familiarity`` on a tiny trained run: the recorded activations are the
post-SwiGLU ones (checked against a recomputation from ``w_gate_up``'s output), the mention's
tokens are the name's, the first-token entropy is the model's, and the command writes its table,
JSON, CSV and plot; bad values are one line and exit code 2."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from archlab.analysis.familiarity.run import collect, mention_span
from archlab.analysis.familiarity.scores import inverse_participation_ratio, spectral_entropy
from archlab.data.tokenizer import load_tokenizer
from archlab.io.checkpoint import load_model
from tests.helpers import run_cli

FAST = ("--folds", "3", "--permutations", "19", "--device", "cpu")


@pytest.fixture(scope="module")
def entity_file(tmp_path_factory):
    from archlab.analysis.familiarity.entities import write_entities

    path = tmp_path_factory.mktemp("entities") / "entities.json"
    write_entities(path, seed=1, per_kind=6)
    return path


def test_mention_span_overlaps():
    offsets = [(0, 4), (4, 5), (5, 9), (9, 14), (14, 15)]
    assert mention_span(offsets, 5, 14) == [2, 3]
    assert mention_span(offsets, 6, 8) == [2]


def test_recorded_activations_are_the_post_swiglu_ones(tiny_run):
    model, _, ckpt = load_model(tiny_run)
    model.eval()
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    items = [{"domain": "module", "kind": "known", "name": "itertools",
              "prompt": "What does the Python module itertools do?"},
             {"domain": "module", "kind": "fabricated", "name": "zipat", "prompt": "How do I use the zipat module?"}]
    data = collect(model, tokenizer, items)
    # Recompute independently: the gate and up halves come out of w_gate_up, the product is silu(g) * u.
    gate_up = []
    handles = [b.mlp.w_gate_up.register_forward_hook(lambda m, i, o: gate_up.append(o[0].detach()))
               for b in model.layers]
    for n, item in enumerate(items):
        enc = tokenizer.encode(item["prompt"], add_special_tokens=False)
        start = item["prompt"].index(item["name"])
        span = mention_span(enc.offsets, start, start + len(item["name"]))
        assert tokenizer.decode([enc.ids[i] for i in span]).strip() == item["name"]
        gate_up.clear()
        with torch.no_grad():
            logits = model(torch.tensor([enc.ids])).logits[0, -1]
        for layer, out in enumerate(gate_up):
            g, u = out.split(model.layers[layer].mlp.hidden, dim=-1)
            act = (F.silu(g) * u)[span].double().numpy()
            assert data["ipr"][n, layer] == pytest.approx(float(inverse_participation_ratio(act[-1])), rel=1e-5)
            assert data["entropy"][n, layer] == pytest.approx(spectral_entropy(act), rel=1e-5, abs=1e-7)
            assert np.allclose(data["last"][layer][n], act[-1], rtol=1e-5, atol=1e-7)
        p = torch.softmax(logits.double(), -1)
        assert data["first_token_entropy"][n] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
        assert data["n_tokens"][n] == len(span)
    for h in handles:
        h.remove()
    # the hooks are gone: a later forward records nothing
    assert all(not m._forward_pre_hooks for b in model.layers for m in [b.mlp.w_down])


def test_cli_writes_table_json_csv_and_plot(tiny_run, entity_file, tmp_path, capsys):
    out = tmp_path / "fam"
    code, stdout, err = run_cli(capsys, "probe", "familiarity", "--ckpt", str(tiny_run), "--entities",
                                str(entity_file), "--out", str(out), *FAST)
    assert code == 0, err
    assert "equal token count" in stdout
    lines = stdout.splitlines()
    assert any(" city " in ln and " fab. " in ln for ln in lines)
    assert any(" all " in ln and " obs. " in ln for ln in lines) and "wrote" in stdout
    summary = json.loads((out / "familiarity.json").read_text())
    assert summary["visit_layers"] == [0, 1] and summary["n_items"] == 36
    assert set(summary["contrasts"]) == {f"{d}/known-vs-{k}" for d in ("city", "module", "all")
                                         for k in ("fabricated", "obscure")}
    r = summary["contrasts"]["module/known-vs-obscure"]
    assert (r["n_known"], r["n_other"]) == (6, 6)
    for name in ("ipr", "entropy"):
        assert len(r[name]["per_layer_auroc"]) == 2 and all(0 <= a <= 1 for a in r[name]["per_layer_auroc"])
        assert 1 / 20 <= r[name]["permutation_p"] <= 1 and set(r[name]["selected_layers"]) <= {0, 1}
        same = r[name]["same_length"]
        assert len(same["per_layer_auroc"]) == 2 and 1 / 20 <= same["permutation_p"] <= 1
    assert len(r["probe"]["per_layer_auroc"]) == 2 and 0 <= r["probe"]["selected_accuracy"] <= 1
    rows = list(csv.DictReader((out / "scores.csv").open()))
    assert len(rows) == 36 and {"ipr_0", "ipr_1", "entropy_1", "first_token_entropy"} <= set(rows[0])
    assert (out / "familiarity.png").read_bytes()[:4] == b"\x89PNG"
    # the same seed gives the same numbers
    code, again, err = run_cli(capsys, "probe", "familiarity", "--ckpt", str(tiny_run), "--entities",
                               str(entity_file), "--out", str(tmp_path / "again"), "--json", *FAST)
    assert code == 0 and json.loads(again)["contrasts"] == summary["contrasts"]


@pytest.mark.parametrize("argv,message", [
    (["--folds", "1"], "argument --folds: must be at least 2"),
    (["--C", "0"], "argument --C: must be a number above 0"),
    (["--seed", "-1"], "argument --seed: must be at least 0"),
    (["--entities", "/nonexistent/entities.json"], "--entities /nonexistent/entities.json: not an entity file"),
])
def test_bad_values_are_one_line_and_exit_2(tiny_run, entity_file, capsys, argv, message):
    base = {"--entities": str(entity_file)}
    if "--entities" in argv:
        base = {}
    args = [a for kv in base.items() for a in kv]
    code, out, err = run_cli(capsys, "probe", "familiarity", "--ckpt", str(tiny_run), "--device", "cpu", *args, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


class CharTokenizer:
    """One token per character (ids below a tiny vocabulary), with offsets, as ``tokenizers`` gives."""

    def encode(self, text: str, add_special_tokens: bool = True):
        from types import SimpleNamespace

        return SimpleNamespace(ids=[ord(c) % 97 for c in text], offsets=[(i, i + 1) for i in range(len(text))])


ITEMS = [{"domain": "city", "kind": "known", "name": "Oslo", "prompt": "Where is Oslo?"}]


def test_a_looped_model_gives_one_column_per_visit_and_a_branch_model_its_primary_rows():
    from archlab.model import build_model
    from tests.helpers import tiny_model_cfg

    torch.manual_seed(0)
    looped = build_model(tiny_model_cfg(schedule="looped")).eval()
    assert looped.visits == [0, 1, 0, 1]
    data = collect(looped, CharTokenizer(), ITEMS)
    assert data["ipr"].shape == (1, 4) and data["n_tokens"][0] == 4
    # the second pass through a layer sees another input, so its column differs from the first's
    assert data["ipr"][0, 0] != data["ipr"][0, 2]

    cfg = tiny_model_cfg()
    torch.manual_seed(0)
    plain = build_model(cfg).eval()
    cfg.branch.enabled = True
    torch.manual_seed(0)
    branched = build_model(cfg).eval()
    branched.load_state_dict(plain.state_dict(), strict=False)
    a, b = collect(plain, CharTokenizer(), ITEMS), collect(branched, CharTokenizer(), ITEMS)
    assert data["ipr"].shape[1] == 4 and a["ipr"].shape == b["ipr"].shape == (1, 2)
    assert np.allclose(a["ipr"], b["ipr"]) and np.allclose(a["first_token_entropy"], b["first_token_entropy"])


def test_an_mlp_without_w_down_is_refused_in_one_line():
    from archlab.errors import UsageError
    from archlab.model import build_model
    from archlab.model.variants.moe import MoEConfig
    from tests.helpers import tiny_model_cfg

    moe = build_model(tiny_model_cfg(ffn="moe", moe=MoEConfig(n_experts=4, top_k=2))).eval()
    with pytest.raises(UsageError, match="layer 0's MLP \\(MoE\\) has no w_down"):
        collect(moe, CharTokenizer(), ITEMS)
