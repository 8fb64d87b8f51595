"""The plug-in contract: a variant defined in this file alone registers into a slot, trains,
decodes from the KV cache, is counted by the accounting and shows up in ``archlab info``."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from archlab.config import make_config
from archlab.errors import ConfigError
from archlab.model import build_model, registry
from archlab.model.accounting import param_counts
from archlab.model.core.cost import Cost
from archlab.train.trainer import train
from tests.helpers import run_cli
from tests.infer.test_generate import assert_matches_full_forward


# ---- the toy variant: a squared-ReLU FFN with its own option ------------------------------------
@dataclass
class SquaredReLUConfig:
    mult: int = 4  # hidden = mult * width

    def validate(self, model) -> None:
        if self.mult < 1:
            raise ConfigError("config error: model.relu2.mult: must be >= 1")


class SquaredReLU(nn.Module):
    """``W_down relu(W_up x)^2``; taps its hidden activation as ``u`` like SwiGLU."""

    def __init__(self, cfg, spec):
        super().__init__()
        self.layer = spec.layer
        hidden = cfg.relu2.mult * spec.d
        self.up = nn.Linear(spec.d, hidden, bias=False)
        self.down = nn.Linear(hidden, spec.d, bias=False)

    def init_parameters(self, init) -> None:
        init.linear(self.up.weight, role="in")
        init.linear(self.down.weight, role="out")

    def forward(self, x, ctx):
        u = ctx.rows.tap(ctx.visit, "u", torch.relu(self.up(x)).square())
        return self.down(u)

    @classmethod
    def cost(cls, cfg, spec) -> Cost:
        n = 2 * spec.d * cfg.relu2.mult * spec.d
        return Cost(params=n, flops=2 * n)

    @classmethod
    def coupling_width(cls, cfg, spec) -> int:
        return cfg.relu2.mult * spec.d


@pytest.fixture
def relu2():
    v = registry.register(registry.Variant("ffn", "relu2", SquaredReLU, options=SquaredReLUConfig, section="relu2"))
    yield v
    registry.unregister("ffn", "relu2")


def toy_cfg(*overrides: str):
    return make_config("tiny", overrides=["model.ffn=relu2", "model.relu2.mult=2", "model.vocab_size=97",
                                          "model.d_model=32", "model.n_layers=2", "model.max_seq_len=64",
                                          "train.seq_len=32",
                                          *overrides])


@pytest.mark.parametrize("branch", [False, True])
def test_toy_ffn_builds_decodes_from_the_cache_and_is_counted(relu2, branch):
    cfg = toy_cfg(f"model.branch.enabled={str(branch).lower()}").model
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    assert all(isinstance(b.mlp, SquaredReLU) for b in model.layers)
    if branch:  # the decode branch couples the toy's hidden tap: its b vectors have its width
        assert model.layers[0].couple_u.a.shape == (1, 2 * 32)
        for name, p in model.named_parameters():
            if ".couple_" in name:
                torch.nn.init.normal_(p, 0.0, 0.5)
    assert param_counts(cfg)["params_total"] == sum(p.numel() for p in model.parameters())
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (11, 6)]
    assert_matches_full_forward(model, seqs, prompt_lens=[4, 2])


def test_toy_ffn_trains_three_steps(relu2, stdlib_data, tmp_path):
    cfg = toy_cfg(f"data.path={stdlib_data}", "model.vocab_size=512", "train.steps=3", "train.warmup_steps=1",
                  "train.eval_every=3", "train.ckpt_every=3", "train.eval_batches=1", "train.batch_size=4",
                  "train.seq_len=32", "train.device=cpu")
    res = train(cfg, tmp_path / "run", show_progress=False)
    assert res.steps == 3 and torch.isfinite(torch.tensor(res.final_val_loss))
    assert (tmp_path / "run" / "ckpt" / "latest").is_file()


def test_toy_ffn_shows_up_in_info(relu2, capsys):
    code, out, err = run_cli(capsys, "info", "--set", "model.ffn=relu2", "--set", "model.relu2.mult=3", "--json")
    assert code == 0, err
    this = json.loads(out)["this config"]
    cfg = make_config("tiny", overrides=["model.ffn=relu2", "model.relu2.mult=3"]).model
    assert this["params_total"] == sum(p.numel() for p in build_model(cfg).parameters())
    code, _, err = run_cli(capsys, "info", "--set", "model.ffn=relu2", "--set", "model.relu2.mult=0")
    assert code == 2 and err.strip() == "archlab: config error: model.relu2.mult: must be >= 1"


# ---- the contract's errors -----------------------------------------------------------------------
def test_unknown_kind_lists_the_registered_ones():
    with pytest.raises(ConfigError, match=r"model.ffn: unknown ffn kind 'gelu'; registered: moe, swiglu"):
        make_config("tiny", overrides=["model.ffn=gelu"])
    with pytest.raises(ConfigError, match=r"model.residual.kind: unknown residual kind 'hyper'; registered: "
                                          r"attnres, delta, standard"):
        make_config("tiny", overrides=["model.residual.kind=hyper"])


def test_an_unknown_section_lists_sections_and_fields():
    with pytest.raises(ConfigError, match=r"unknown key 'model.moee'; allowed here: .*ffn.*moe"):
        make_config("tiny", overrides=["model.moee.top_k=2"])


def test_excluded_pairs_are_refused_naming_both():
    v = registry.register(registry.Variant("init", "toy_exclusive", "math:sqrt", excludes=("ffn:moe",)))
    try:
        with pytest.raises(ConfigError, match=r"model.ffn: init 'toy_exclusive' cannot be combined with ffn 'moe'"):
            make_config("tiny", overrides=["model.init=toy_exclusive", "model.ffn=moe"])
        make_config("tiny", overrides=["model.init=toy_exclusive"])  # alone it is fine
    finally:
        registry.unregister(v.slot, v.kind)


def test_a_section_cannot_have_two_option_classes():
    @dataclass
    class Other:
        x: int = 0

    with pytest.raises(ValueError, match="model.moe already holds"):
        registry.register(registry.Variant("ffn", "other", "math:sqrt", options=Other, section="moe"))


def test_hash_ignores_sections_a_run_does_not_use():
    base = make_config("tiny")
    assert "moe" not in base.model.to_dict() and "branch" not in base.model.to_dict()
    assert "moe" in make_config("tiny", overrides=["model.ffn=moe"]).model.to_dict()
    # a changed option is kept even where unused, so nothing a user wrote is silently dropped
    assert make_config("tiny", overrides=["model.moe.top_k=3"]).hash() != base.hash()


def test_config_checks_import_no_torch():
    code = ("import sys; from archlab.config import make_config; "
            "make_config('tiny', overrides=['model.ffn=moe', 'model.branch.enabled=true', "
            "'model.residual.kind=attnres']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
