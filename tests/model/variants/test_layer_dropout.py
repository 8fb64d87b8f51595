"""Layer dropout: p_max 0 is the plain model bit for bit; the probabilities follow the formula per
visit and step; a dropped block executes no FLOPs for the rows that drop it; the expected output
is the undropped model's; it composes with a loop; the accounting's training FLOPs are the run's
expected ones; training runs through the trainer and resumes exactly; bad options are one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import assert_config_refused, assert_same_function_bitwise

from archlab.config import make_config
from archlab.io.checkpoint import resolve_checkpoint
from archlab.model import build_model
from archlab.model.core.context import Context
from archlab.model.accounting import costs, mfu_flops_per_token, per_layer
from archlab.model.variants.layer_dropout.module import step_flops
from archlab.model.variants.layer_dropout.schedule import mean_drop_rate
from archlab.train.trainer import Run, train
from tests.conftest import small_config
from tests.infer.test_generate import assert_matches_full_forward

V, D = 97, 32
DROP = "model.schedule=layer_dropout"


def cfg_of(*overrides: str, layers: int = 4):
    return make_config("tiny", overrides=[f"model.vocab_size={V}", f"model.d_model={D}", f"model.n_layers={layers}",
                                          "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
                                          "train.seq_len=32", *overrides]).model


def built(*overrides: str, layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(cfg_of(*overrides, layers=layers))


def tokens(batch: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, t), generator=torch.Generator().manual_seed(seed))


def test_p_max_zero_is_the_plain_model_bit_for_bit():
    plain, drop = built(), built(DROP, "model.layer_dropout.p_max=0")
    assert_same_function_bitwise(plain, drop, tokens(4))  # both in training mode


def test_probabilities_rise_with_depth_and_fall_over_the_run():
    sched = built(DROP, "model.layer_dropout.p_max=0.4", layers=5).schedule
    for progress in (0.0, 0.25, 0.9, 1.0):
        sched.set_training_progress(progress)
        want = [0.4 * v / 4 * (1 - progress) for v in range(5)]
        assert sched.drop_probabilities() == pytest.approx(want, abs=1e-15)
    constant = built(DROP, "model.layer_dropout.p_max=0.4", "model.layer_dropout.decay=false", layers=5).schedule
    constant.set_training_progress(0.7)
    assert constant.drop_probabilities() == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert mean_drop_rate(0.4) == pytest.approx(sum(constant.drop_probabilities()) / 5)


def test_each_row_drops_a_visit_with_its_probability():
    sched = built(DROP, "model.layer_dropout.p_max=0.6", "model.layer_dropout.decay=false", layers=3).schedule
    rows = 20000
    assert sched.keep(0, rows, torch.device("cpu")) is None  # the first visit never drops
    torch.manual_seed(5)
    for visit, p in ((1, 0.3), (2, 0.6)):
        kept, scale = sched.keep(visit, rows, torch.device("cpu"))
        assert abs(kept.numel() / rows - (1 - p)) < 4 * (p * (1 - p) / rows) ** 0.5
        assert sched.kept_fraction[visit] == kept.numel() / rows
        assert scale.item() == pytest.approx(1 / (1 - p))
        assert torch.equal(kept, kept.unique())  # each kept row once, in order


def test_a_dropped_block_executes_no_flops_for_the_rows_that_drop_it():
    model = built(DROP, "model.layer_dropout.p_max=0.5", "model.layer_dropout.decay=false")
    sched, batch = model.schedule, 4
    x = tokens(batch, 17)
    with sched.forcing({}):  # every row runs every block
        full = step_flops(model, x[:, :-1], x[:, 1:])
        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            model(x[:, :-1], x[:, 1:], exit_after=3).loss.backward()
    block_per_row = (full - counter.get_total_flops()) / batch  # the last block, forward and backward
    assert block_per_row > 0
    with sched.forcing({1: [0], 2: [0, 1, 2, 3], 3: [1, 2]}):  # 7 (row, block) pairs dropped
        forced = step_flops(model, x[:, :-1], x[:, 1:])
    assert full - forced == 7 * block_per_row
    assert [sched.kept_fraction[v] for v in range(4)] == [1.0, 0.75, 0.0, 0.5]


def test_a_dropped_block_leaves_its_rows_as_the_model_without_it():
    model = built(DROP, "model.layer_dropout.p_max=0.5")
    model.set_training_progress(1.0)  # p = 0: kept updates unscaled, so rows compare with the plain model
    x = tokens(2)
    with model.schedule.forcing({3: [0]}):
        out = model(x).logits
    with torch.no_grad():
        torch.testing.assert_close(out[0], model(x, exit_after=3).logits[0], rtol=0, atol=1e-6)
        model.eval()
        torch.testing.assert_close(out[1], model(x).logits[1], rtol=0, atol=1e-6)
    out[0].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in model.layers[3].parameters())


def test_the_expected_output_is_the_undropped_models():
    """Two layers: the second drops with p = 0.5, so the state before the final norm is
    ``h1 + m/(1-p) (Attn + FFN)(h1)`` with ``m ~ Bernoulli(1-p)`` per row, whose mean over many
    rows is the undropped state. A model without the 1/(1-p) scale would land halfway."""
    p, rows = 0.5, 4096
    model = built(DROP, f"model.layer_dropout.p_max={p}", "model.layer_dropout.decay=false", layers=2)
    states = []
    model.norm.register_forward_hook(lambda mod, args, out: states.append(args[0]))
    x = tokens(1, 6).expand(rows, 6)
    torch.manual_seed(7)
    with torch.no_grad():
        model(x)  # training mode: one draw per row
        model.eval()
        model(x[:1])
        model(x[:1], exit_after=1)
    dropped, full, first = states[0], states[1][0], states[2][0]
    update = full - first
    mean = dropped.mean(0)
    error = (mean - full).norm() / update.norm()
    unscaled_error = (first + (mean - first) * (1 - p) - full).norm() / update.norm()
    assert 0.6 > model.schedule.kept_fraction[1] > 0.4
    assert error < 0.08 < 0.3 < unscaled_error


def test_it_drops_visits_of_a_loop_and_decodes_every_visit():
    loop = ("model.looped.loops=2", "model.tie_embeddings=true", "model.looped.channel=disco")
    model = built(DROP, "model.layer_dropout.schedule=looped", *loop, "model.layer_dropout.p_max=0.7",
                  "model.layer_dropout.decay=false")
    assert model.visits == [0, 1, 2, 3] * 2 and model.between is not None
    plain = costs(cfg_of("model.schedule=looped", *loop), 32)
    for key, value in costs(model.cfg, 32).items():  # the loop's costs, its channel included, but training's
        assert key == "train_flops_per_token" and value < plain[key] or value == plain[key], key
    assert model.schedule.drop_probabilities() == pytest.approx([0.1 * v for v in range(8)])
    torch.manual_seed(3)
    x = tokens(8, 17)
    model(x[:, :-1], x[:, 1:]).loss.backward()
    assert 0 < model.schedule.kept_fraction[7] < 1
    assert_matches_full_forward(model.eval(), [tokens(1, 11, seed=s)[0].tolist() for s in (1, 2)], prompt_lens=[4, 7])


@pytest.mark.parametrize("decay", [True, False])
def test_training_flops_are_the_runs_expected_flops(decay):
    p_max, context = 0.3, 32
    seq, drop = cfg_of(), cfg_of(DROP, f"model.layer_dropout.p_max={p_max}", f"model.layer_dropout.decay={decay}")
    s, d = costs(seq, context), costs(drop, context)
    layers = per_layer(seq, context)
    # visit v drops with p_v = p_max v / 3; averaged over a linear decay to 0, half of that
    mean_drop = [p_max * v / 3 * (0.5 if decay else 1.0) for v in range(4)]
    saved = 3 * sum(p * r["prefill_flops_per_token"] for p, r in zip(mean_drop, layers))
    assert d["train_flops_per_token"] == pytest.approx(s["train_flops_per_token"] - saved, rel=1e-12)
    assert mfu_flops_per_token(drop, context) < mfu_flops_per_token(seq, context)
    for key in ("prefill_flops_per_token", "decode_flops_per_token", "kv_bytes_per_token", "decode_bytes_per_step",
                "params_total", "params_active"):
        assert d[key] == s[key], key  # inference runs every block


def model_tensors(run_dir):
    return load_file(resolve_checkpoint(run_dir) / "model.safetensors")


def test_training_runs_and_resumes_exactly(stdlib_data, tmp_path):
    cfg = small_config(stdlib_data, DROP, "model.layer_dropout.p_max=0.6", "model.n_layers=3", "train.steps=4",
                       "train.ckpt_every=2", "train.eval_every=2", "train.device=cpu")
    straight = train(cfg, tmp_path / "straight", show_progress=False)
    train(cfg, tmp_path / "resumed", show_progress=False, stop_after_steps=2)
    resumed = train(cfg, tmp_path / "resumed", show_progress=False)
    assert straight.steps == resumed.steps == 4
    a, b = model_tensors(tmp_path / "straight"), model_tensors(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    run = Run(cfg, tmp_path / "hook")
    run.train_step(3)  # the trainer tells the model how far the run is
    assert run.model.schedule.progress == 3 / 4
    assert run.model.schedule.drop_probabilities() == pytest.approx([0.0, 0.075, 0.15])


BAD = {
    "p_max": ([DROP, "model.layer_dropout.p_max=1"], "model.layer_dropout.p_max: must be a probability in [0, 1)"),
    "itself": ([DROP, "model.layer_dropout.schedule=layer_dropout"], "model.layer_dropout.schedule: must name"),
    "unknown": ([DROP, "model.layer_dropout.schedule=spiral"], "model.layer_dropout.schedule: must name"),
    "attnres": ([DROP, "model.residual.kind=attnres"], "model.residual.kind: layer dropout adds"),
    "branch": ([DROP, "model.branch.enabled=true"], "model.schedule: layer dropout draws per row"),
    "looped_option": ([DROP, "model.layer_dropout.schedule=looped", "model.looped.loops=0"],
                      "model.looped.loops: must be at least 1"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_options_are_one_line(name):
    assert_config_refused(cfg_of, *BAD[name])


ZOO = {
    "prism": ["model.heads=prism", "model.prism.head_dims=[8,4]"],
    "triplu": ["model.ffn=triplu"],
    "gamma": ["model.init=gamma", "model.norm_eps=1e-12"],
    "layerrope": ["model.norm=layerrope", "model.layerrope.learnable=true"],
    "width": ["model.width=variable", "model.variable_width.head_dim=8", "model.variable_width.multiple_of=16"],
    "moe": ["model.ffn=moe", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.shared_expert=true"],
}


@pytest.mark.parametrize("option", list(ZOO))
def test_it_composes_with_the_zoo(option):
    """Training steps with drops (every row of a visit may drop it), then every visit in cached
    decoding, beside every other zoo option and MoE (its balance loss over the kept rows)."""
    model = built(DROP, "model.layer_dropout.p_max=0.8", "model.layer_dropout.decay=false", *ZOO[option])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(4)
    for step in range(3):
        x = tokens(4, 17, seed=step)
        loss = model(x[:, :-1], x[:, 1:]).loss
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert min(model.schedule.kept_fraction.values()) < 1
    assert_matches_full_forward(model.eval(), [tokens(1, 9, seed=s)[0].tolist() for s in (1, 2)], prompt_lens=[3, 5])


# ---- the early-exit loss ---------------------------------------------------------------------------
EXIT = [DROP, "model.layer_dropout.p_max=0"]  # no drops: the loss is a deterministic function


def exit_nll(model, x, n):
    """The next-token loss read out after ``n`` visits, in the model's dtype (the readout's own
    ``nll`` rounds its logits to float32)."""
    idx = x[:, :-1]
    hidden = model.run(model.tok_emb(idx), Context(rope=model.position.tables(idx.shape[1])), exit_after=n)
    return torch.nn.functional.cross_entropy(model.logits(hidden).flatten(0, 1), x[:, 1:].flatten())


@pytest.mark.parametrize("exits", [[1, 3], []])
def test_the_exit_loss_adds_the_weighted_mean_of_its_exits_losses(exits):
    weight = 0.7
    model = built(*EXIT, f"model.layer_dropout.exit_loss={weight}", f"model.layer_dropout.exits={exits}").double()
    x = tokens(3, 13)
    out = model(x[:, :-1], x[:, 1:])
    chosen = exits or [1, 2, 3]  # empty: every exit before the last
    want = sum(exit_nll(model, x, n) for n in chosen) / len(chosen)
    assert out.nll.item() == pytest.approx(exit_nll(model, x, 4).item(), rel=1e-6)  # float32 readout
    assert out.aux_loss.item() == pytest.approx(weight * want.item(), rel=1e-12)
    assert torch.equal(out.loss, out.nll + out.aux_loss)
    # and its gradient is that sum's: the exits train the layers below them through the shared head
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(out.loss, params, retain_graph=True)
    ref = torch.autograd.grad(out.nll + weight * want, params)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-8)  # attention backward: float32-level


def test_the_exit_loss_is_training_only():
    with_loss = built(*EXIT, "model.layer_dropout.exit_loss=2", "model.layer_dropout.exits=[2]").eval()
    without = built(*EXIT).eval()
    x = tokens(2, 12)
    a, b = with_loss(x[:, :-1], x[:, 1:]), without(x[:, :-1], x[:, 1:])
    assert a.aux_loss is None and torch.equal(a.loss, b.loss)
    with_loss.train()
    assert with_loss(x[:, :-1], x[:, 1:]).loss > with_loss(x[:, :-1], x[:, 1:]).nll


def test_the_compiled_exit_loss_equals_the_eager_one():
    model = built(*EXIT, "model.layer_dropout.exit_loss=0.5")
    x = tokens(2, 12)
    eager = model(x[:, :-1], x[:, 1:]).loss
    compiled = torch.compile(model, backend="aot_eager")(x[:, :-1], x[:, 1:]).loss
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_the_exit_loss_counts_its_readouts_in_training_flops_only():
    context = 32
    plain = costs(cfg_of(*EXIT), context)
    two = costs(cfg_of(*EXIT, "model.layer_dropout.exit_loss=1", "model.layer_dropout.exits=[1,2]"), context)
    assert two["train_flops_per_token"] == pytest.approx(plain["train_flops_per_token"] + 3 * 2 * (2 * D * V), rel=1e-12)
    every = costs(cfg_of(*EXIT, "model.layer_dropout.exit_loss=1"), context)
    assert every["train_flops_per_token"] == pytest.approx(plain["train_flops_per_token"] + 3 * 3 * (2 * D * V), rel=1e-12)
    for key in ("prefill_flops_per_token", "decode_flops_per_token", "decode_bytes_per_step", "params_total"):
        assert two[key] == plain[key], key


EXIT_BAD = {
    "negative": (["model.layer_dropout.exit_loss=-1"], "model.layer_dropout.exit_loss: must be a finite weight"),
    "last": (["model.layer_dropout.exit_loss=1", "model.layer_dropout.exits=[4]"],
             "model.layer_dropout.exits: an early-exit loss may follow visits [1, 2, 3]"),
    "zero": (["model.layer_dropout.exits=[0]"], "model.layer_dropout.exits: an early-exit loss may follow"),
    "twice": (["model.layer_dropout.exit_loss=1", "model.layer_dropout.exits=[2,2]"],
              "model.layer_dropout.exits: names an exit twice"),
    "diffusion": (["model.layer_dropout.exit_loss=1", "model.objective=uniform-diffusion"],
                  "model.layer_dropout.exit_loss: the early-exit loss reads"),
}


@pytest.mark.parametrize("name", list(EXIT_BAD))
def test_bad_exit_options_are_one_line(name):
    extra, message = EXIT_BAD[name]
    assert_config_refused(cfg_of, [*EXIT, *extra], message)
