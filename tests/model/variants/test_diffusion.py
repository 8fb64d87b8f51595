"""Uniform diffusion on the one model (``model/variants/diffusion/module.py`` and its hooks in the
core): the options and their one-line refusals, bidirectional attention against a float64
reference, time conditioning, the training estimator against the exact ELBO of a tiny model, a
reproducible evaluation bound, the sampler on a model, the accounting, and the command line
(train, ``eval`` naming the bound, ``generate --diffusion-steps``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from archlab.config import make_config
from archlab.errors import ConfigError, UsageError
from archlab.model import accounting, build_model
from archlab.model.core.context import Context
from archlab.model.core.layers import Attention, RopeTables
from archlab.model.core.spec import LayerSpec
from archlab.model.variants.diffusion.module import BIDIRECTIONAL
from archlab.model.variants.diffusion.process import alpha, elbo_integrand
from tests.conftest import small_config
from tests.helpers import run_cli, tiny_model_cfg

V = 97


def diffusion_model(seed=0, schedule="linear", **over):
    cfg = tiny_model_cfg(objective="uniform-diffusion", **over)
    cfg.diffusion.schedule = schedule
    torch.manual_seed(seed)
    return build_model(cfg.validate())


# ---- options ---------------------------------------------------------------------------------------
def test_the_default_objective_leaves_the_config_and_its_hash_as_they_were():
    base = tiny_model_cfg()
    assert "objective" not in base.to_dict() and "diffusion" not in base.to_dict()
    cfg = tiny_model_cfg(objective="uniform-diffusion")
    assert cfg.to_dict()["objective"] == "uniform-diffusion"
    assert cfg.to_dict()["diffusion"] == {"schedule": "linear", "time_sampling": "stratified", "eval_seed": 0}
    assert cfg.uses("rows", "uniform-diffusion") and base.uses("rows", "primary")


@pytest.mark.parametrize("overrides,match", [
    (["model.objective=masked"], r"model\.objective: must be one of autoregressive, uniform-diffusion, got 'masked'"),
    (["model.objective=uniform-diffusion", "model.branch.enabled=true"], "cannot be combined"),
    (["model.objective=uniform-diffusion", "model.hidden_decoding.enabled=true"], "cannot be combined"),
    (["model.objective=uniform-diffusion", "model.schedule=looped"], r"model\.schedule: .*'sequential', got 'looped'"),
    (["model.objective=uniform-diffusion", "model.diffusion.schedule=quadratic"],
     r"model\.diffusion\.schedule: must be one of linear, cosine"),
    (["model.objective=uniform-diffusion", "model.diffusion.time_sampling=sobol"], "time_sampling"),
])
def test_bad_or_incompatible_options_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        make_config("tiny", overrides=overrides)
    assert "\n" not in str(e.value)


# ---- the denoiser ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sinks", [False, True])
def test_bidirectional_attention_against_a_float64_reference(sinks):
    torch.manual_seed(0)
    spec = LayerSpec(layer=0, d=32, n_heads=4, n_kv_heads=2, head_dim=8, hidden=64, sinks=sinks)
    attn = Attention(spec).double()
    if sinks:
        with torch.no_grad():
            attn.sink.normal_()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    tables = build_model(tiny_model_cfg()).position.tables(11)  # head dim 8, as this layer's
    ctx = Context(rope=RopeTables({hd: (c.double(), s.double()) for hd, (c, s) in tables.items()}), rows=BIDIRECTIONAL)
    got = attn(x, ctx)
    q, k, v = attn.wqkv(x).split([32, 16, 16], dim=-1)
    q = ctx.rope.rotate(q.view(2, 11, 4, 8).transpose(1, 2), 8)
    k = ctx.rope.rotate(k.view(2, 11, 2, 8).transpose(1, 2), 8).repeat_interleave(2, dim=1)
    v = v.view(2, 11, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)  # every key, no mask
    if sinks:
        scores = torch.cat([attn.sink.view(1, 4, 1, 1).expand(2, 4, 11, 1), scores], dim=-1)
        v = torch.cat([torch.zeros(2, 4, 1, 8, dtype=torch.float64), v], dim=2)
    want = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 11, 32))
    assert torch.allclose(got, want, atol=1e-10)


def test_every_position_sees_every_other_and_the_noise_level():
    model = diffusion_model().eval()
    z = torch.randint(0, V, (1, 16))
    changed = z.clone()
    changed[0, -1] = (z[0, -1] + 1) % V
    t = torch.tensor([0.5])
    with torch.no_grad():
        a = model.rows.denoise(model, z, t)
        b = model.rows.denoise(model, changed, t)
        c = model.rows.denoise(model, z, torch.tensor([0.1]))
    assert not torch.allclose(a[0, 0], b[0, 0])  # the first position depends on the last token
    assert not torch.allclose(a, c)  # and on t
    # whereas the autoregressive model's first position does not
    torch.manual_seed(0)
    ar = build_model(tiny_model_cfg()).eval()
    with torch.no_grad():
        assert torch.equal(ar(z).logits[0, 0], ar(changed).logits[0, 0])


def test_training_gives_the_time_map_and_every_layer_a_gradient():
    model = diffusion_model().train()
    x = torch.randint(0, V, (4, 16))
    out = model(x, x)
    assert out.nll_is_bound and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_training_lowers_the_bound_on_structured_data():
    """Sequences that count up from a random start (entropy log(16)/8 nats per token): 200 AdamW
    steps take the bound from a uniform guess, log 16, well below it."""
    model = diffusion_model(vocab_size=16, max_seq_len=16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)

    def counting() -> torch.Tensor:
        return (torch.randint(0, 16, (64, 1), generator=g) + torch.arange(8)) % 16

    for _ in range(200):
        x = counting()
        loss = model(x, x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        bound = sum(float(model(x, x).nll) for x in [counting() for _ in range(10)]) / 10
    assert bound < 0.8 * math.log(16), bound


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_the_training_estimate_matches_the_exact_elbo_of_a_tiny_model(schedule):
    """Two positions over a 5-token vocabulary: the exact negative ELBO sums the integrand over all
    25 noisy sequences and integrates it over t by the midpoint rule in u = sqrt(t) (smooth at
    t = 0; fine enough for the time embedding's fastest oscillation); the estimator the trainer
    uses (one noise level and one draw per sequence) averages to it."""
    model = diffusion_model(seed=1, schedule=schedule, vocab_size=5, init_std=0.5)
    x0 = torch.tensor([[2, 4]])
    points = 800
    u = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    t, dt = (u ** 2).repeat_interleave(25), (2 * u / points).repeat_interleave(25)
    z = torch.cartesian_prod(torch.arange(5), torch.arange(5)).repeat(points, 1)
    a = alpha(t, schedule)[:, None]
    q = torch.where(z == x0, a + (1 - a) / 5, (1 - a) / 5).prod(-1)  # q_t(z | x0)
    with torch.no_grad():
        log_p = torch.log_softmax(model.rows.denoise(model, z, t.float()).double(), -1)
        f = elbo_integrand(log_p, x0.expand_as(z), z, t.float(), schedule).double().sum(-1)
        exact = float((dt * q * f).sum()) / 2  # per token
        model.train()
        torch.manual_seed(2)
        draws = torch.tensor([float(model(x0.expand(1000, 2), x0.expand(1000, 2)).nll) for _ in range(40)])
    est, se = draws.mean().item(), draws.std().item() / math.sqrt(len(draws))
    assert abs(est - exact) < 4 * se + 0.005 * exact, (est, se, exact)
    assert exact > math.log(5)  # an untrained model's bound is above a fair guess of each token


def test_evaluation_draws_the_same_noise_for_the_same_windows():
    model = diffusion_model().eval()
    x = torch.randint(0, V, (4, 16))
    with torch.no_grad():
        a, b = float(model(x, x).nll), float(model(x, x).nll)
        model.rows.options.eval_seed = 1
        c = float(model(x, x).nll)
    assert a == b and a != c


def test_left_to_right_entry_points_are_refused_in_one_line():
    model = diffusion_model().eval()
    x = torch.randint(0, V, (2, 8))
    with pytest.raises(UsageError, match="--diffusion-steps"):
        model(x)
    with pytest.raises(UsageError, match="predicts no next token"):
        model.prefill(x, model.new_cache(2, 16), torch.tensor([8, 8]))
    with pytest.raises(UsageError, match="early exit"):
        model(x, x, exit_after=1)


def test_the_sampler_keeps_the_prompt_and_repeats_under_a_seed():
    model = diffusion_model().eval()
    prompts = [[5, 6, 7], []]
    runs = [model.rows.sample(model, prompts, 12, 4, 1.0, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0].shape == (2, 12) and torch.equal(runs[0], runs[1])
    assert runs[0][0, :3].tolist() == [5, 6, 7] and bool(((runs[0] >= 0) & (runs[0] < V)).all())
    other = model.rows.sample(model, prompts, 12, 4, 1.0, torch.Generator().manual_seed(4))
    assert not torch.equal(other[1], runs[0][1])


# ---- accounting --------------------------------------------------------------------------------------
def test_training_flops_count_the_full_attention_square():
    base, diff = tiny_model_cfg(), tiny_model_cfg(objective="uniform-diffusion")
    seq = 32
    extra_keys = seq - (seq + 1) / 2  # bidirectional rows see every key, causal ones half on average
    attention = sum(4 * 32 * extra_keys for _ in range(base.n_layers))  # 4 q_dim per key and layer
    assert accounting.train_flops_per_token(diff, seq) - accounting.train_flops_per_token(base, seq) == 3 * attention
    params = accounting.param_counts(diff)["params_total"] - accounting.param_counts(base)["params_total"]
    assert params == 32 * 32  # the time map
    assert params == sum(p.numel() for p in build_model(diff).parameters()) - sum(
        p.numel() for p in build_model(base).parameters())


# ---- the command line ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def diffusion_run(stdlib_data, tmp_path_factory):
    from archlab.train.trainer import train

    out = tmp_path_factory.mktemp("runs") / "diffusion"
    train(small_config(stdlib_data, "train.steps=4", "train.ckpt_every=4", "train.eval_every=4",
                       "train.final_eval_tokens=512", "model.objective=uniform-diffusion"), out, show_progress=False)
    return out


def test_a_trained_checkpoint_reports_a_bound_and_generates(diffusion_run, tiny_run, capsys):
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(diffusion_run), "--device", "cpu", "--batches", "2",
                             "--json")
    assert code == 0, err
    score = json.loads(out)
    assert score["bound"] is True and score["bpb_bound"] == score["bpb"] > 0
    code, out, _ = run_cli(capsys, "eval", "--ckpt", str(tiny_run), "--device", "cpu", "--batches", "2", "--json")
    assert code == 0 and "bpb_bound" not in json.loads(out)  # the autoregressive bpb is exact
    code, out, _ = run_cli(capsys, "eval", "--ckpt", str(diffusion_run), "--device", "cpu", "--batches", "2")
    assert code == 0 and "bits/byte (an upper bound: the negative ELBO)" in out
    records = [json.loads(line) for line in (diffusion_run / "metrics.jsonl").read_text().splitlines()]
    marked = {r["kind"] for r in records if r.get("bpb_bound") == r.get("bpb") is not None}
    assert marked == {"val", "final"}  # training's records say they are bounds too
    code, out, err = run_cli(capsys, "generate", "--ckpt", str(diffusion_run), "--prompt", "def ", "--prompt", "",
                             "--max-new-tokens", "12", "--diffusion-steps", "3", "--device", "cpu")
    assert code == 0, err
    assert out.startswith("def ") and "12 tokens per row by 3 denoising steps" in err


@pytest.mark.parametrize("which,extra,match", [
    ("diffusion", [], "give --diffusion-steps N"),
    ("diffusion", ["--diffusion-steps", "2", "--speculate", "2"], "--speculate drafts"),
    ("diffusion", ["--diffusion-steps", "2", "--max-new-tokens", "5000"], "must fit the model's context"),
    ("autoregressive", ["--diffusion-steps", "2"], "predicts the next token"),
])
def test_generate_refuses_what_does_not_apply_in_one_line(which, extra, match, diffusion_run, tiny_run, capsys):
    ckpt = diffusion_run if which == "diffusion" else tiny_run
    code, _, err = run_cli(capsys, "generate", "--ckpt", str(ckpt), "--prompt", "x", "--device", "cpu", *extra)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err
