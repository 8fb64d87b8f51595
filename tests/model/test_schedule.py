"""The ``schedule`` slot: a schedule that loops (runs layers again) or skips layers is one toy kind
registered in this file. The core keys the KV cache, the residual sites, the decode branch's taps
and the per-run costs by *visit*, so each trains, decodes from the cache exactly as its full
forward computes (fp32), and is counted once per visit (parameters once per layer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from archlab.config import make_config
from archlab.errors import ConfigError
from archlab.infer.engine import Engine
from archlab.infer.sampling import SamplingParams
from archlab.model import build_model, registry
from archlab.model.accounting import costs, param_counts, parts, per_layer
from archlab.train.distributed import prepare_blocks
from archlab.train.trainer import train
from tests.infer.test_engine import uncached_greedy
from tests.infer.test_generate import assert_matches_full_forward

V, D, L = 97, 32, 4
SCHEDULES = {
    "toy-looped": [0, 1, 2, 3, 0, 1, 2, 3],  # a looped transformer: the same weights run twice
    "toy-skipping": [0, 1, 3],  # early exit / a dropped layer: layer 2 never runs
    "toy-reversed": [3, 2, 1, 0],  # a reordering
    "toy-bad": [0, 4],  # no layer 4
}
VARIANTS = {  # the residual streams that route over sites, and the decode branch's taps
    "baseline": [],
    "attnres": ["model.residual.kind=attnres"],
    "block_mhar": ["model.residual.kind=attnres", "model.residual.blocks=3", "model.residual.heads=2"],
    "delta": ["model.residual.kind=delta", "model.residual.heads=2"],
    "branch": ["model.branch.enabled=true"],
    "branch_attnres": ["model.branch.enabled=true", "model.residual.kind=attnres"],
}


class Visits:
    """A toy schedule kind: the fixed visit list named by the kind."""

    def __init__(self, cfg):
        self.cfg = cfg

    def visits(self):
        return SCHEDULES[self.cfg.schedule]


@pytest.fixture(autouse=True)
def schedules():
    for kind in SCHEDULES:
        registry.register(registry.Variant("schedule", kind, Visits))
    yield
    for kind in SCHEDULES:
        registry.unregister("schedule", kind)


def run_cfg(schedule: str, *overrides: str):
    return make_config("tiny", overrides=[f"model.schedule={schedule}", f"model.vocab_size={V}",
                                          f"model.d_model={D}", f"model.n_layers={L}", "model.n_heads=4",
                                          "model.n_kv_heads=2", "model.max_seq_len=64", "train.seq_len=32",
                                          *overrides])


def randomised(model):
    """Zero-initialised routing queries, gates and coupling vectors made random, so that a wrong
    site, tap or cache entry changes the result."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("residual.") or ".couple_" in name:
                p.add_(torch.randn_like(p) * 0.5)
    return model


def trained(cfg, steps: int = 3):
    """A few AdamW steps on random tokens (fp32, CPU); the model in eval mode."""
    torch.manual_seed(0)
    model = randomised(build_model(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, V, (2, 17), generator=g)
        out = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("schedule", ["toy-looped", "toy-skipping"])
def test_trains_and_cached_decoding_equals_the_full_forward(schedule, variant):
    cfg = run_cfg(schedule, *VARIANTS[variant]).model
    model = trained(cfg)
    n = len(SCHEDULES[schedule])
    assert model.new_cache(1, 8).n_layers == n  # one K/V entry per visit
    if cfg.residual.kind != "standard":
        assert model.residual.n_sites == 2 * n and len(model.residual.queries) == 2 * n + 1
    seqs = [torch.randint(1, V, (k,)).tolist() for k in (12, 7, 15)]
    assert_matches_full_forward(model, seqs, prompt_lens=[5, 1, 9])


def test_a_looped_layer_writes_two_cache_entries_from_different_states():
    model = trained(run_cfg("toy-looped").model)
    cache = model.new_cache(1, 16)
    with torch.no_grad():
        model.prefill(torch.randint(1, V, (1, 6)), cache, torch.tensor([6]))
    for layer in range(L):  # visit v and v + 4 run the same weights on different hidden states
        (k1, v1), (k2, v2) = cache.layer(layer), cache.layer(layer + L)
        assert not torch.allclose(k1[:, :, :6], k2[:, :, :6]) and not torch.allclose(v1[:, :, :6], v2[:, :, :6])


@pytest.mark.parametrize("schedule", ["toy-looped", "toy-skipping"])
def test_the_engine_decodes_a_looped_or_skipping_model_as_uncached_greedy(schedule):
    model = trained(run_cfg(schedule, "model.residual.kind=attnres").model)
    prompts, lengths = [[5, 6, 7], [8], [9, 10, 11, 12, 13]], [5, 3, 4]
    reqs = Engine(model, slots=2).generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0) for n in lengths])
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.tokens == uncached_greedy(model, p, n)


@pytest.mark.parametrize("variant", ["branch", "branch_attnres"])
def test_a_looped_branch_prefill_couples_each_visit_in_one_pass(variant):
    """The branch's one-pass prefill (follower rows appended to the primary's time axis) equals
    the former two-pass prefill under a loop: each visit's taps couple to that visit's primary
    activation, and each visit's cache entry holds the primary's keys/values only."""
    from tests.model.variants.test_branch import primary_only, two_pass_prefill

    model = randomised(build_model(run_cfg("toy-looped", *VARIANTS[variant]).model)).eval()
    idx = torch.randint(1, V, (3, 12), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([12, 4, 7])
    base = primary_only(model)
    with torch.no_grad():
        cache, ref_cache = model.new_cache(3, 32), base.new_cache(3, 32)
        got = model.prefill(idx, cache, lengths)
        ref = two_pass_prefill(model, idx, model.new_cache(3, 32), lengths)
        base.prefill(idx, ref_cache, lengths)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert cache.n_layers == 2 * L
    for visit in range(cache.n_layers):
        for kb, kp in zip(cache.layer(visit), ref_cache.layer(visit)):
            torch.testing.assert_close(kb, kp, atol=1e-6, rtol=0)


def test_activation_checkpointing_recomputes_each_visit_with_its_own_taps():
    """A checkpointed block is called again in backward, after the loop moved on: it must see its
    own visit (the branch's followers read the primary's taps of that visit)."""
    cfg = run_cfg("toy-looped", "model.branch.enabled=true").model
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = randomised(build_model(cfg))
        if ckpt:
            prepare_blocks(model, SimpleNamespace(compile=False, activation_checkpointing=True))
        x = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))
        model(x[:, :-1], x[:, 1:]).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_looped_model_trains_through_the_trainer(stdlib_data, tmp_path):
    cfg = run_cfg("toy-looped", "model.residual.kind=attnres", f"data.path={stdlib_data}", "model.vocab_size=512",
                  "train.steps=3", "train.warmup_steps=1", "train.eval_every=3", "train.ckpt_every=3",
                  "train.eval_batches=1", "train.batch_size=4", "train.device=cpu")
    res = train(cfg, tmp_path / "run", show_progress=False)
    assert res.steps == 3 and torch.isfinite(torch.tensor(res.final_val_loss))


# ---- costs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("context,batch", [(32, 1), (256, 4)])
def test_looped_costs_are_the_sequential_costs_with_per_visit_terms_doubled(context, batch):
    seq, loop = run_cfg("sequential").model, run_cfg("toy-looped").model
    s, lp = costs(seq, context, batch), costs(loop, context, batch)
    head = 2 * D * V  # the one per-token term outside the layers (standard residual, untied head)
    for key in ("prefill_flops_per_token", "decode_flops_per_token", "train_flops_per_token"):
        per_visit = s[key] - (3 * head if key.startswith("train") else head)
        assert lp[key] == pytest.approx(s[key] + per_visit, rel=1e-12), key
    assert lp["kv_bytes_per_token"] == 2 * s["kv_bytes_per_token"]
    for key in ("params_total", "params_active", "params_embedding"):  # weights once per layer
        assert lp[key] == s[key]
    assert lp["params_total"] == sum(p.numel() for p in build_model(loop).parameters())
    layer_weights = s["params_total"] - 2 * V * D - D  # embedding, head, final norm
    kv = s["kv_bytes_per_token"]
    extra = layer_weights * 2 + batch * context * kv + batch * kv  # a second read of every layer
    assert lp["decode_bytes_per_step"] == s["decode_bytes_per_step"] + extra
    rows = per_layer(loop, context)
    assert [r["visits"] for r in rows] == [2] * L
    assert [r["prefill_flops_per_token"] for r in rows] == [2 * r["prefill_flops_per_token"]
                                                             for r in per_layer(seq, context)]


@pytest.mark.parametrize("residual", [["model.residual.kind=attnres"],
                                      ["model.residual.kind=attnres", "model.residual.blocks=3"],
                                      ["model.residual.kind=delta"]])
def test_residual_costs_count_sites_per_visit(residual):
    for schedule, n in (("sequential", L), ("toy-looped", 2 * L), ("toy-skipping", 3)):
        cfg = run_cfg(schedule, *residual).model
        model = build_model(cfg)
        assert param_counts(cfg)["params_total"] == sum(p.numel() for p in model.parameters())
        assert model.residual.n_sites == 2 * n
    # the looped stream routes exactly as the stream of a sequential model with twice the layers
    loop = [p.cost for p in parts(run_cfg("toy-looped", *residual).model) if p.name == "residual"]
    deep = [p.cost for p in parts(run_cfg("sequential", f"model.n_layers={2 * L}", *residual).model)
            if p.name == "residual"]
    assert loop == deep


def test_a_skipped_layer_has_parameters_but_no_flops_kv_or_decode_reads():
    seq, skip = run_cfg("sequential").model, run_cfg("toy-skipping").model
    s, k = costs(seq, 64), costs(skip, 64)
    one = {r["layer"]: r for r in per_layer(seq, 64)}[2]  # the layer the schedule skips
    assert k["params_total"] == s["params_total"] == sum(p.numel() for p in build_model(skip).parameters())
    assert k["params_active"] == s["params_active"] - one["params"]
    assert k["prefill_flops_per_token"] == s["prefill_flops_per_token"] - one["prefill_flops_per_token"]
    assert k["kv_bytes_per_token"] == s["kv_bytes_per_token"] - one["kv_bytes_per_token"]
    assert k["decode_bytes_per_step"] == s["decode_bytes_per_step"] - 2 * one["params"] - 65 * one["kv_bytes_per_token"]
    assert [r["visits"] for r in per_layer(skip, 64)] == [1, 1, 0, 1]


# ---- config ---------------------------------------------------------------------------------------
def test_a_reordering_schedule_still_decodes_from_the_cache():
    model = trained(run_cfg("toy-reversed", "model.residual.kind=attnres").model)
    assert_matches_full_forward(model, [torch.randint(1, V, (k,)).tolist() for k in (9, 5)], prompt_lens=[3, 2])


def test_a_schedule_naming_no_layer_is_one_line():
    with pytest.raises(ConfigError) as e:
        run_cfg("toy-bad")
    assert str(e.value) == ("config error: model.schedule: 'toy-bad' visits layers [0, 4]; a schedule needs at least "
                            "one visit, each a layer index in 0..3")


WIDTHS = ("model.width=variable", "model.variable_width.multiple_of=16")  # widths 32 and 16 at d=32


def test_a_loop_over_varying_widths_is_refused_naming_both_options():
    with pytest.raises(ConfigError) as e:
        run_cfg("toy-looped", *WIDTHS)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config error: model.schedule: 'toy-looped' runs a layer more than once, "
                                              "which cannot be combined with model.width 'variable'")
    model = trained(run_cfg("toy-skipping", *WIDTHS).model)  # skipping resizes as one pass does: fine
    assert len(set(model.widths)) > 1
    assert_matches_full_forward(model, [torch.randint(1, V, (k,)).tolist() for k in (9, 5)], prompt_lens=[3, 2])


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_skipping_schedule_is_refused_by_the_distributed_layouts(parallel):
    """A skipped layer's parameters get no gradient, which DDP's reducer waits for forever."""
    with pytest.raises(ConfigError) as e:
        run_cfg("toy-skipping", f"train.parallel={parallel}")
    assert str(e.value) == (f"config error: train.parallel: {parallel} cannot train model.schedule 'toy-skipping', "
                            "which skips layers [2]: train it in one process (train.parallel none)")
    assert run_cfg("toy-looped", f"train.parallel={parallel}").train.parallel == parallel  # loops are fine


class DropThirdForFirstRow:
    """A toy layer-dropout kind: every layer visited, and in training layer 2 dropped for row 0
    (a fixed draw, so the test knows which rows lost which layer): ``keep`` names the rows that
    run the visit and the scale of their update."""

    def __init__(self, cfg):
        self.cfg = cfg

    def visits(self):
        return list(range(self.cfg.n_layers))

    def keep(self, visit, rows, device):
        if visit != 2:
            return None
        return torch.arange(1, rows, device=device), 1.0


def test_a_schedule_can_drop_visits_in_training_only():
    registry.register(registry.Variant("schedule", "drop-third", DropThirdForFirstRow))
    try:
        torch.manual_seed(0)
        seq = build_model(run_cfg("sequential").model)
        drop = build_model(run_cfg("drop-third").model)
        skip = build_model(run_cfg("toy-skipping").model)  # [0, 1, 3]
        for m in (drop, skip):
            m.load_state_dict(seq.state_dict())
        x = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
        drop.train()
        out = drop(x).logits
        with torch.no_grad():
            torch.testing.assert_close(out[0], skip(x).logits[0], rtol=0, atol=1e-6)  # row 0: no layer 2
            torch.testing.assert_close(out[1], seq(x).logits[1], rtol=0, atol=1e-6)  # row 1: every layer
        out[0].sum().backward()
        assert all(p.grad is None or not p.grad.any() for p in drop.layers[2].parameters())
        assert any(p.grad is not None and p.grad.any() for p in drop.layers[1].parameters())
        drop.eval()  # evaluation and decoding run every visit
        with torch.no_grad():
            assert torch.equal(drop(x).logits, seq(x).logits)
        assert_matches_full_forward(drop, [torch.randint(1, V, (k,)).tolist() for k in (9, 5)], prompt_lens=[3, 2])
    finally:
        registry.unregister("schedule", "drop-third")
