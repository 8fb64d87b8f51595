"""The fused readout (``kernels.linear_cross_entropy``): loss and both gradients equal the unfused
``F.cross_entropy(hidden @ weight.T, targets)`` in float64 for every chunking, ignored targets
included, and under bf16 autocast to its rounding; the model's loss without logits equals its
loss with them (and rows kinds with another readout fall back to it); no tensor of the logits'
size is kept for the backward; the trainer's ``train.fused_readout`` trains the same run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from archlab.config import make_config
from archlab.errors import ConfigError
from archlab.kernels.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy, linear_readout_stats
from archlab.model import build_model
from archlab.train.trainer import resolve_fused_readout, train
from tests.conftest import small_config


def _inputs(n=37, d=12, v=53, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = IGNORE_INDEX
    return hidden, weight, targets


def _reference(hidden, weight, targets):
    loss = F.cross_entropy(hidden @ weight.T, targets)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
def test_loss_and_gradients_equal_the_unfused_ones_in_float64(chunk):
    hidden, weight, targets = _inputs()
    want = _reference(hidden, weight, targets)
    loss = linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    got = (loss, *torch.autograd.grad(loss * 1.7, (hidden, weight)))  # a scaled upstream gradient
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1] * 1.7, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[2], want[2] * 1.7, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [5, 1000])
def test_every_statistic_and_its_gradient_equal_the_reference_in_float64(chunk):
    hidden, weight, targets = _inputs()
    targets = targets.clamp_min(0)
    upstream = [torch.randn(len(targets), dtype=torch.float64, generator=torch.Generator().manual_seed(s))
                for s in range(3)]
    z = hidden @ weight.T
    want = (z.logsumexp(-1), z.gather(1, targets[:, None])[:, 0], (2 * z.log_softmax(-1)).logsumexp(-1))
    want_grads = torch.autograd.grad(sum((u * s).sum() for u, s in zip(upstream, want)), (hidden, weight))
    got = linear_readout_stats(hidden, weight, targets, squared=True, chunk=chunk)
    got_grads = torch.autograd.grad(sum((u * s).sum() for u, s in zip(upstream, got)), (hidden, weight))
    for a, b in zip((*got, *got_grads), (*want, *want_grads)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert linear_readout_stats(hidden, weight, targets)[2] is None


def test_every_target_ignored_gives_zero_loss_and_gradients():
    hidden, weight, targets = _inputs()
    loss = linear_cross_entropy(hidden, weight, torch.full_like(targets, IGNORE_INDEX), chunk=8)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_under_bf16_autocast_the_product_rounds_as_the_unfused_linear_does():
    hidden, weight, targets = _inputs(n=64, d=32, v=97, dtype=torch.float32, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _reference(hidden, weight, targets)
        loss = linear_cross_entropy(hidden, weight, targets, chunk=16)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want[0], rtol=1e-6, atol=1e-6)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    # bf16 products on both sides; the unfused backward also multiplies in bf16
    torch.testing.assert_close(gh, want[1], rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw, want[2], rtol=2e-2, atol=2e-3)


def test_bad_shapes_and_chunks_are_refused():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="hidden \\[N, d\\]"):
        linear_cross_entropy(hidden[None], weight, targets)
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(hidden, weight, targets, chunk=0)


def _model(*overrides):
    torch.manual_seed(0)
    cfg = make_config("tiny", overrides=["model.vocab_size=211", "model.d_model=32", "model.n_layers=2",
                                         "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
                                         "train.seq_len=16", *overrides]).model
    return build_model(cfg)


MODELS = {
    "baseline": [],
    "tied": ["model.tie_embeddings=true"],
    "looped": ["model.schedule=looped", "model.looped.loops=2"],
    "decode-branch": ["model.branch.enabled=true"],  # the mixture, from the readout statistics
    "decode-branch-2-coupled": ["model.branch.enabled=true", "model.branch.n_branches=2", "model.branch.coupling=true"],
    "decode-branch-only": ["model.branch.enabled=true", "model.branch.readout=branch"],
    # alpha = sum p^2 unclamped: the gate's gradient runs through logsumexp(2 z)
    "decode-branch-free-gate": ["model.branch.enabled=true", "model.branch.alpha_min=0"],
    "hidden-decoding": ["model.hidden_decoding.enabled=true", "model.hidden_decoding.streams=2"],
    "hidden-decoding-3-mixing": ["model.hidden_decoding.enabled=true", "model.hidden_decoding.streams=3",
                                 "model.hidden_decoding.mix_layers=[0,1]"],
}
FUSED = {"PrimaryRows", "BranchRows", "HiddenRows"}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_models_loss_without_logits_is_its_loss_with_them(name):
    model = _model(*MODELS[name])
    idx = torch.randint(0, 211, (3, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.roll(idx, -1, 1)
    full = model(idx, targets)
    grads = torch.autograd.grad(full.loss, list(model.parameters()), allow_unused=True)
    lean = model(idx, targets, return_logits=False)
    assert (lean.logits is None) == (type(model.rows).__name__ in FUSED)
    torch.testing.assert_close(lean.loss, full.loss, rtol=1e-6, atol=1e-6)
    for g_lean, g_full in zip(torch.autograd.grad(lean.loss, list(model.parameters()), allow_unused=True), grads):
        assert (g_lean is None) == (g_full is None)
        if g_full is not None:
            torch.testing.assert_close(g_lean, g_full, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["baseline", "decode-branch", "hidden-decoding"])
def test_no_tensor_of_the_logits_size_is_kept_for_the_backward(name):
    """Of the tensors autograd saves, none with a vocabulary axis is as large as the logits (the
    head's weight [V, d] is saved, and small); attention's own saved tensors do not count."""
    model = _model(*MODELS[name])
    idx = torch.randint(0, 211, (4, 16), generator=torch.Generator().manual_seed(3))
    logits_size = idx.numel() * 211

    def largest_saved(**kwargs) -> int:
        sizes = [0]

        def pack(t):
            if 211 in t.shape:
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx, torch.roll(idx, -1, 1), **kwargs).loss.backward()
        return max(sizes)

    assert largest_saved() >= logits_size  # the check can see the logits when they are kept
    assert largest_saved(return_logits=False) < logits_size


def test_the_trainer_trains_the_same_run_with_the_fused_readout(stdlib_data, tmp_path):
    extra = ("train.steps=4", "train.eval_every=4", "train.log_every=1", "train.ckpt_every=4")
    plain = train(small_config(stdlib_data, *extra), tmp_path / "plain", show_progress=False)
    fused_cfg = small_config(stdlib_data, *extra, "train.fused_readout=true")
    fused = train(fused_cfg, tmp_path / "fused", show_progress=False)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "train"] for d in ("plain", "fused")]
    assert len(losses[0]) == 4
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert fused.val_curve[-1]["loss"] == pytest.approx(plain.val_curve[-1]["loss"], rel=1e-5)
    assert fused_cfg.hash() == small_config(stdlib_data, *extra).hash()  # how the loss is computed, not what


@pytest.mark.parametrize("overrides, expected", [
    ((), False),  # auto: one readout keeps its logits (no smaller peak measured)
    (("model.branch.enabled=true",), True),  # auto: the branch's two readouts use the statistics
    (("model.branch.enabled=true", "train.fused_readout=false"), False),  # an explicit choice wins
    (("train.fused_readout=true",), True),
])
def test_fused_readout_auto_follows_the_rows_kind(overrides, expected):
    cfg = make_config("tiny", overrides=list(overrides))
    assert resolve_fused_readout(cfg.train, build_model(cfg.model)) is expected
    # a layout field: an explicit choice is recorded in the run's config, auto is not (so the
    # configs and run ids of runs from before the option existed stay what they were)
    assert ("fused_readout" in cfg.to_dict()["train"]) is (cfg.train.fused_readout is not None)
    assert cfg.hash() == make_config("tiny", overrides=[o for o in overrides if "fused" not in o]).hash()


def test_fused_readout_refuses_a_value_that_is_not_a_bool():
    with pytest.raises(ConfigError, match="train.fused_readout"):
        make_config("tiny", overrides=["train.fused_readout=maybe"])
