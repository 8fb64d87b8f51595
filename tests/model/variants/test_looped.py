"""Looped Transformer and DiscoLoop: the visits of prelude, loop and coda; K=1 is the plain model
bit for bit; the channel against a float64 reference and a finite-difference gradient; alpha 0 is a
plain loop; realignment acts outside training only; cached decoding and the engine reproduce the
full forward; the accounting counts K passes and the channel; bad options are one line."""

from __future__ import annotations

import pytest
import torch

from archlab.config import make_config
from archlab.infer.engine import Engine
from archlab.infer.sampling import SamplingParams
from archlab.model import build_model
from archlab.model.accounting import costs, param_counts, per_layer
from archlab.model.variants.looped.module import DiscreteChannel
from archlab.model.variants.looped.schedule import Looped
from tests.helpers import assert_config_refused, assert_same_function_bitwise, run_cli
from tests.infer.test_engine import uncached_greedy
from tests.infer.test_generate import assert_matches_full_forward

V, D, L = 97, 32, 4
TIED = "model.tie_embeddings=true"
DISCO = ("model.schedule=looped", TIED, "model.looped.channel=disco")


def cfg_of(*overrides: str):
    return make_config("tiny", overrides=[f"model.vocab_size={V}", f"model.d_model={D}", f"model.n_layers={L}",
                                          "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
                                          "train.seq_len=32", *overrides]).model


def built(*overrides: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(cfg_of(*overrides))


def tokens(batch: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, t), generator=torch.Generator().manual_seed(seed))


def test_visits_run_prelude_once_the_middle_k_times_and_the_coda_once():
    sched = Looped(cfg_of("model.n_layers=6", "model.schedule=looped", "model.looped.loops=3",
                          "model.looped.prelude=1", "model.looped.coda=2"))
    assert sched.visits() == [0, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5]
    assert sched.loop_starts() == [4, 7]  # the first visit of iterations 2 and 3
    model = built("model.schedule=looped", "model.looped.loops=3")
    assert model.visits == [0, 1, 2, 3] * 3 and model.new_cache(1, 8).n_layers == 3 * L


@pytest.mark.parametrize("prelude,coda", [(0, 0), (1, 2)])
def test_one_loop_is_the_plain_model_bit_for_bit(prelude, coda):
    plain = built()
    once = built("model.schedule=looped", "model.looped.loops=1", f"model.looped.prelude={prelude}",
                 f"model.looped.coda={coda}")
    assert once.visits == list(range(L))
    for (name, a), (_, b) in zip(plain.state_dict().items(), once.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert_same_function_bitwise(plain, once, tokens())


def test_disco_with_alpha_zero_is_the_plain_loop_bit_for_bit():
    loop = built("model.schedule=looped", TIED, "model.looped.prelude=1")
    disco = built(*DISCO, "model.looped.prelude=1", "model.looped.alpha=0")
    assert disco.between is not None and sorted(disco.between.before) == [1 + (L - 1)]
    x = tokens()
    assert torch.equal(loop(x).logits, disco(x).logits)
    moved = built(*DISCO, "model.looped.prelude=1")  # alpha 1: the channel changes the output
    assert not torch.allclose(loop(x).logits, moved(x).logits, atol=1e-3)


def reference_transform(h: torch.Tensor, table: torch.Tensor, tau: float, alpha, eps: float) -> torch.Tensor:
    """``h + alpha RMSNorm(sum_v softmax(W h / tau)_v W[v])`` in float64, one vocabulary row at a time."""
    h, table = h.double(), table.double()
    logits = torch.stack([(h * table[v]).sum(-1) for v in range(table.shape[0])], dim=-1) / tau
    p = torch.exp(logits - logits.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    phi = sum(p[..., v:v + 1] * table[v] for v in range(table.shape[0]))
    normed = phi / torch.sqrt(phi.pow(2).mean(-1, keepdim=True) + eps)
    return h + alpha * normed


def channel(alpha_mode: str = "fixed", chunk: int = 0, tau: float = 0.7, alpha: float = 0.8, d: int = D
            ) -> DiscreteChannel:
    cfg = cfg_of(*DISCO, f"model.d_model={d}", f"model.looped.tau={tau}", f"model.looped.alpha={alpha}",
                 f"model.looped.alpha_mode={alpha_mode}", f"model.looped.chunk_tokens={chunk}")
    ch = DiscreteChannel(cfg, [L])
    if alpha_mode == "learned":  # a gate away from its initial value, so that it matters
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            ch.gate_weight.copy_(torch.randn(d, generator=g))
            ch.gate_bias.fill_(0.3)
    return ch


@pytest.mark.parametrize("alpha_mode", ["fixed", "learned"])
def test_the_channel_matches_a_float64_reference(alpha_mode):
    ch = channel(alpha_mode).double()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    table = torch.randn(V, D, generator=g, dtype=torch.float64)
    alpha = 0.8
    if alpha_mode == "learned":
        normed = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + ch.eps)
        alpha = 2 * 0.8 * torch.sigmoid(normed @ ch.gate_weight[:, None] + ch.gate_bias)
    ref = reference_transform(h, table, 0.7, alpha, ch.eps)
    torch.testing.assert_close(ch.transform(h, table), ref, rtol=1e-12, atol=1e-12)
    ch32 = ch.float()  # float32 agrees to its rounding
    torch.testing.assert_close(ch32.transform(h.float(), table.float()).double(), ref, rtol=1e-4, atol=1e-4)


def test_a_learned_gate_starts_at_alpha():
    model = built(*DISCO, "model.looped.alpha_mode=learned", "model.looped.alpha=0.3")
    h = torch.randn(2, 3, D)
    torch.testing.assert_close(model.between.gate_value(h), torch.full((2, 3, 1), 0.3))
    assert param_counts(model.cfg)["params_total"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("alpha_mode,chunk", [("fixed", 0), ("learned", 0), ("learned", 4)])
def test_gradient_through_the_channel_matches_finite_differences(alpha_mode, chunk):
    d = 8  # a narrow case: gradcheck perturbs every input element
    ch = channel(alpha_mode, chunk, d=d).double()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, d, generator=g, dtype=torch.float64, requires_grad=True)
    table = torch.randn(7, d, generator=g, dtype=torch.float64).requires_grad_()
    inputs = (h, table) + ((ch.gate_weight, ch.gate_bias) if alpha_mode == "learned" else ())
    assert torch.autograd.gradcheck(lambda h, table, *gate: ch.transform(h, table), inputs)


def test_chunked_channel_equals_the_whole_one_with_gradients():
    whole, chunked = channel("learned", 0), channel("learned", 3)
    g = torch.Generator().manual_seed(2)
    h, table = torch.randn(2, 5, D, generator=g), torch.randn(V, D, generator=g)
    grads = []
    for ch in (whole, chunked):
        hh, tt = h.clone().requires_grad_(), table.clone().requires_grad_()
        out = ch.transform(hh, tt)
        out.square().sum().backward()
        grads.append((out.detach(), hh.grad, tt.grad, ch.gate_weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_realignment_runs_the_channel_outside_training_only():
    loop = built("model.schedule=looped", TIED)
    realigned = built(*DISCO, "model.looped.realign=true", "model.looped.alpha=0.5")
    disco = built(*DISCO, "model.looped.alpha=0.5")
    realigned.load_state_dict(loop.state_dict())  # the plain loop's weights are all it has
    x = tokens()
    assert torch.equal(realigned(x).logits, loop(x).logits)  # training: a plain loop
    for m in (loop, realigned, disco):
        m.eval()
    with torch.no_grad():
        assert torch.equal(realigned(x).logits, disco(x).logits)  # evaluation: the channel runs
        assert not torch.allclose(realigned(x).logits, loop(x).logits, atol=1e-3)


def randomised_trained(*overrides: str):
    """A few AdamW steps (fp32) from an init whose zero gate is moved, then eval mode."""
    model = built(*overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("between.") or ".couple_" in name:
                p.add_(0.5 * torch.randn_like(p))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = tokens(seed=10 + step)
        loss = model(x[:, :-1], x[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


CACHED = {
    "looped_k3_prelude_coda": ("model.schedule=looped", "model.looped.loops=3", "model.looped.prelude=1",
                               "model.looped.coda=1"),
    "disco_prelude_coda": (*DISCO, "model.looped.prelude=1", "model.looped.coda=1", "model.looped.tau=0.5"),
    "disco_learned_chunked": (*DISCO, "model.looped.alpha_mode=learned", "model.looped.chunk_tokens=5"),
    "disco_realigned": (*DISCO, "model.looped.realign=true", "model.looped.loops=3"),
    "disco_branch": (*DISCO, "model.branch.enabled=true"),
}


@pytest.mark.parametrize("name", list(CACHED))
def test_cached_decoding_equals_the_full_forward(name):
    model = randomised_trained(*CACHED[name])
    assert model.new_cache(1, 8).n_layers == len(model.visits)
    seqs = [torch.randint(1, V, (k,), generator=torch.Generator().manual_seed(k)).tolist() for k in (13, 6, 10)]
    assert_matches_full_forward(model, seqs, prompt_lens=[5, 1, 8])


def test_the_engine_generates_a_discoloop_model_as_uncached_greedy():
    model = randomised_trained(*DISCO, "model.looped.prelude=1")
    prompts, lengths = [[5, 6, 7], [8], [9, 10, 11, 12]], [5, 3, 4]
    reqs = Engine(model, slots=2).generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0) for n in lengths])
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.tokens == uncached_greedy(model, p, n)


# ---- costs ------------------------------------------------------------------------------------------
def test_costs_count_k_passes_of_the_looped_layers_and_params_once():
    loops, context, batch = 3, 32, 2
    seq = cfg_of()
    loop = cfg_of("model.schedule=looped", f"model.looped.loops={loops}", "model.looped.prelude=1",
                  "model.looped.coda=1")
    s, lp = costs(seq, context, batch), costs(loop, context, batch)
    layers = {r["layer"]: r for r in per_layer(seq, context)}
    assert [r["visits"] for r in per_layer(loop, context)] == [1, loops, loops, 1]
    extra = {key: (loops - 1) * (layers[1][key] + layers[2][key])
             for key in ("prefill_flops_per_token", "decode_flops_per_token", "kv_bytes_per_token", "params")}
    for key in ("prefill_flops_per_token", "decode_flops_per_token"):
        assert lp[key] == pytest.approx(s[key] + extra[key]), key
    # training: 3x the forward at the mean causal context (seq_len 32 -> 16.5 keys, as prefill at 32)
    train = s["train_flops_per_token"] + 3 * extra["prefill_flops_per_token"]
    assert lp["train_flops_per_token"] == pytest.approx(train)
    assert lp["kv_bytes_per_token"] == s["kv_bytes_per_token"] + extra["kv_bytes_per_token"]  # one entry per visit
    kv = extra["kv_bytes_per_token"]
    assert lp["decode_bytes_per_step"] == s["decode_bytes_per_step"] + 2 * extra["params"] + batch * (context + 1) * kv
    for key in ("params_total", "params_active", "params_embedding"):
        assert lp[key] == s[key]


@pytest.mark.parametrize("mode", ["fixed", "learned", "realign"])
def test_costs_count_the_channel_between_loops(mode):
    loops, context = 3, 32
    plain = cfg_of("model.schedule=looped", TIED, f"model.looped.loops={loops}")
    opts = {"fixed": [], "learned": ["model.looped.alpha_mode=learned"], "realign": ["model.looped.realign=true"]}
    disco = cfg_of(*DISCO, f"model.looped.loops={loops}", *opts[mode])
    p, d = costs(plain, context), costs(disco, context)
    gate = D + 1 if mode == "learned" else 0
    per_boundary = 4 * V * D + (2 * D if gate else 0)  # W h and softmax . W, plus the gate's dot product
    channel = (loops - 1) * per_boundary
    assert d["prefill_flops_per_token"] == p["prefill_flops_per_token"] + channel
    assert d["decode_flops_per_token"] == p["decode_flops_per_token"] + channel
    assert d["train_flops_per_token"] == p["train_flops_per_token"] + (0 if mode == "realign" else 3 * channel)
    assert d["params_total"] == p["params_total"] + gate
    assert d["decode_bytes_per_step"] == p["decode_bytes_per_step"] + 2 * (loops - 1) * (V * D + gate)


# ---- options ----------------------------------------------------------------------------------------
BAD = {
    "loops": (["model.schedule=looped", "model.looped.loops=0"], "model.looped.loops: must be at least 1, got 0"),
    "no_middle": (["model.schedule=looped", "model.looped.prelude=2", "model.looped.coda=2"],
                  "model.looped.prelude: prelude 2 + coda 2 leave no layer to loop of model.n_layers=4"),
    "untied": (["model.schedule=looped", "model.looped.channel=disco"], "model.tie_embeddings: DiscoLoop's channel"),
    "attnres": ([*DISCO, "model.residual.kind=attnres"], "model.residual.kind: DiscoLoop's channel rewrites"),
    "one_loop": ([*DISCO, "model.looped.loops=1"], "model.looped.channel: disco acts between loop iterations"),
    "tau": ([*DISCO, "model.looped.tau=0"], "model.looped.tau: must be a positive number, got 0.0"),
    "realign_plain": (["model.schedule=looped", "model.looped.realign=true"], "model.looped.realign: realigns"),
    "realign_learned": ([*DISCO, "model.looped.realign=true", "model.looped.alpha_mode=learned"],
                        "model.looped.alpha_mode: learned gates would never train under realign"),
    "channel": (["model.schedule=looped", "model.looped.channel=soft"], "model.looped.channel"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_options_are_one_line(name):
    assert_config_refused(cfg_of, *BAD[name])


def test_a_bad_option_on_the_command_line_exits_2(capsys):
    code, out, err = run_cli(capsys, "info", "--set", "model.schedule=looped", "--set", "model.looped.loops=0")
    assert code == 2 and out == "" and err.strip().count("\n") == 0 and "model.looped.loops" in err


def test_a_discoloop_run_trains_and_generates_from_the_command_line(stdlib_data, tmp_path, capsys):
    from tests.conftest import small_config
    from archlab.train.trainer import train

    cfg = small_config(stdlib_data, *DISCO, "model.looped.prelude=1", "model.looped.alpha_mode=learned",
                       "train.steps=3", "train.eval_every=3", "train.ckpt_every=3", "train.device=cpu")
    res = train(cfg, tmp_path / "run", show_progress=False)
    assert res.steps == 3 and res.final_val_loss == res.final_val_loss  # finite, not NaN
    code, out, err = run_cli(capsys, "generate", "--ckpt", str(tmp_path / "run"), "--prompt", "def main(",
                             "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu")
    assert code == 0, err
    assert out.startswith("def main(") and len(out.strip()) > len("def main(")


ZOO = {
    "prism": ["model.heads=prism", "model.prism.head_dims=[8,4]"],
    "triplu": ["model.ffn=triplu"],
    "gamma": ["model.init=gamma", "model.norm_eps=1e-12"],
    "layerrope": ["model.norm=layerrope", "model.layerrope.learnable=true"],
    "moe": ["model.ffn=moe", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.shared_expert=true"],
    "attnres": ["model.residual.kind=attnres", "model.residual.heads=2"],
}


@pytest.mark.parametrize("option", list(ZOO))
def test_a_loop_composes_with_the_zoo(option):
    """The plain loop (with a prelude) beside every other zoo option, MoE and MHAR; the channel
    beside those it accepts (every one but MHAR, whose stream it would bypass)."""
    channel = [] if option == "attnres" else [TIED, "model.looped.channel=disco"]
    model = randomised_trained("model.schedule=looped", "model.looped.prelude=1", *channel, *ZOO[option])
    assert param_counts(model.cfg)["params_total"] == sum(p.numel() for p in model.parameters())
    seqs = [torch.randint(1, V, (k,), generator=torch.Generator().manual_seed(k)).tolist() for k in (9, 5)]
    assert_matches_full_forward(model, seqs, prompt_lens=[3, 2])
