"""Hidden Decoding: streams, stream-factorised attention, cached decode, accounting, options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from archlab.errors import ConfigError
from archlab.infer.bench import bench_decode
from archlab.infer.engine import Engine
from archlab.infer.sampling import SamplingParams
from archlab.model import accounting, build_model
from archlab.model.variants.hidden.module import deinterleave, interleave
from tests.helpers import tiny_model_cfg
from tests.infer.test_generate import assert_matches_full_forward

V = 97


def hidden_cfg(streams=2, mix_layers=None, **over):
    cfg = tiny_model_cfg(**over)
    cfg.hidden_decoding.enabled = True
    cfg.hidden_decoding.streams = streams
    cfg.hidden_decoding.mix_layers = mix_layers
    return cfg.validate()


def hidden_model(seed=0, streams=2, mix_layers=None, **over):
    torch.manual_seed(seed)
    return build_model(hidden_cfg(streams, mix_layers, **over)).eval()


# ---- one stream is the baseline --------------------------------------------------------------------
def test_one_stream_is_the_baseline_bit_for_bit():
    torch.manual_seed(0)
    base = build_model(tiny_model_cfg(n_layers=3)).eval()
    one = hidden_model(seed=0, streams=1, mix_layers=[0, 2], n_layers=3)
    assert base.state_dict().keys() == one.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), one.state_dict().values()))
    x = torch.randint(0, V, (3, 19))
    with torch.no_grad():
        a, b = base(x, x), one(x, x)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    cache_a, cache_b = base.new_cache(3, 32), one.new_cache(3, 32)
    lengths = torch.tensor([19, 7, 12])
    with torch.no_grad():
        assert torch.equal(base.prefill(x, cache_a, lengths), one.prefill(x, cache_b, lengths))
        step = torch.randint(0, V, (3, 1))
        assert torch.equal(base.decode(step, cache_a, lengths), one.decode(step, cache_b, lengths))


def test_interleave_puts_token_t_stream_s_at_t_times_n_plus_s():
    x = torch.arange(3 * 2 * 4).view(3 * 2, 1, 4, 1)  # stream-major rows of 2 sequences, 3 streams
    y = interleave(x, 3)
    assert y.shape == (2, 1, 12, 1)
    for b in range(2):
        for t in range(4):
            for s in range(3):
                assert y[b, 0, t * 3 + s, 0] == x[s * 2 + b, 0, t, 0]
    assert torch.equal(deinterleave(y, 3), x)


# ---- a float64 reference with explicit dense masks ----------------------------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, pos, theta):
    """RoPE at positions ``pos``; the tables in float32, as the model keeps them."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos.float()[:, None] * inv
    cos, sin = ang.cos().double(), ang.sin().double()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_reference(model, idx):
    """Logits of the interleaved n*T sequence, built position by position in float64: every
    layer attends under an explicit [n*T, n*T] mask (same stream and an earlier-or-equal token;
    or, in a mixing layer, any earlier-or-equal interleaved position)."""
    cfg = model.cfg
    n, (b, t) = cfg.hidden_decoding.streams, idx.shape
    sd = {k: v.double() for k, v in model.state_dict().items()}
    tables = [sd["stream_emb.weight"][s * V: (s + 1) * V] for s in range(n - 1)] + [sd["tok_emb.weight"]]
    x = torch.stack([table[idx] for table in tables], dim=2).reshape(b, t * n, -1)  # position t*n + s
    p = torch.arange(t * n)
    token, stream = p // n, p % n
    within = (stream[:, None] == stream[None]) & (token[None] <= token[:, None])
    mixing = p[None] <= p[:, None]
    h, kvh, hd = cfg.n_heads, cfg.kv_heads, cfg.dim_per_head
    for layer in range(cfg.n_layers):
        pre = f"layers.{layer}."
        a = _rms(x, sd[pre + "attn_norm.weight"], cfg.norm_eps) @ sd[pre + "attn.wqkv.weight"].T
        q, k, v = a.split([h * hd, kvh * hd, kvh * hd], dim=-1)
        q = _rotate(q.view(b, -1, h, hd).transpose(1, 2), token, cfg.rope_theta)
        k = _rotate(k.view(b, -1, kvh, hd).transpose(1, 2), token, cfg.rope_theta).repeat_interleave(h // kvh, 1)
        v = v.view(b, -1, kvh, hd).transpose(1, 2).repeat_interleave(h // kvh, 1)
        mask = mixing if layer in cfg.hidden_decoding.mixing(cfg.n_layers) else within
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t * n, h * hd)
        x = x + o @ sd[pre + "attn.wo.weight"].T
        g, u = (_rms(x, sd[pre + "mlp_norm.weight"], cfg.norm_eps) @ sd[pre + "mlp.w_gate_up.weight"].T).chunk(2, -1)
        x = x + (F.silu(g) * u) @ sd[pre + "mlp.w_down.weight"].T
    scored = _rms(x[:, n - 1:: n], sd["norm.weight"], cfg.norm_eps)
    return scored @ sd["lm_head.weight"].T


@pytest.mark.parametrize("streams,mix_layers", [(2, None), (3, [0, 2]), (3, []), (2, [0, 1, 2])])
def test_forward_equals_a_dense_mask_reference_in_float64(streams, mix_layers):
    model = hidden_model(seed=1, streams=streams, mix_layers=mix_layers, n_layers=3).double()
    idx = torch.randint(0, V, (2, 13))
    with torch.no_grad():
        got = model(idx).logits
    assert got.shape == (2, 13, V)  # scored over T positions, as the baseline
    # atol: the model normalises and rotates in float32 whatever its dtype (RMSNorm, RoPE), which
    # leaves ~4e-8 here; a wrong mask or stream order moves logits by ~1e-3 or more.
    torch.testing.assert_close(got, dense_reference(model, idx), atol=1e-6, rtol=0)


def test_hidden_streams_reach_the_loss_only_through_mixing_layers():
    """The gradient of the hidden streams' table is zero without a mixing layer, not with one
    (so the reference test above cannot pass with streams that never meet)."""
    x = torch.randint(0, V, (2, 12))
    for mix, reached in (([], False), ([1], True)):
        model = hidden_model(streams=3, mix_layers=mix).train()
        model(x, x).loss.backward()
        assert bool(model.stream_emb.weight.grad.abs().sum() > 0) == reached


# ---- attention cost: no n*T x n*T tensor in the within-stream layers ----------------------------------
class _Shapes(TorchDispatchMode):
    """Every tensor an op returns, by shape."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.shapes.append(tuple(o.shape))
        return out


def _square(shapes, size):
    """Shapes with two dimensions of ``size`` (a score matrix or a mask over those positions)."""
    return [s for s in shapes if sum(d == size for d in s) >= 2]


def test_within_stream_layers_build_no_nT_by_nT_tensor(monkeypatch):
    n, t = 3, 40  # n*T = 120 is no other dimension here (2 sequences: 240 rows, FFN 128, vocab 97)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[-2], k.shape[-2], kwargs.get("attn_mask")))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    idx = torch.randint(0, V, (2, t))
    model = hidden_model(streams=n, mix_layers=[], n_layers=3, max_seq_len=t)
    with torch.no_grad(), _Shapes() as seen:
        model(idx)
    assert len(calls) == 3 and all(qt == kt == t and mask is None for qt, kt, mask in calls)
    assert _square(seen.shapes, n * t) == []
    # The spies see a mixing layer's interleaved attention, and a dense mask where one is built.
    calls.clear()
    mixed = hidden_model(streams=n, mix_layers=[1], n_layers=3, max_seq_len=t)
    with torch.no_grad():
        mixed(idx)
    assert sorted(kt for _, kt, _ in calls) == [t, t, n * t]
    with torch.no_grad(), _Shapes() as seen:
        dense_reference(mixed.double(), idx[:, :t])
    assert _square(seen.shapes, n * t)


# ---- cached decode -------------------------------------------------------------------------------------
@pytest.mark.parametrize("streams,mix_layers,sinks", [(2, None, False), (2, [], False), (4, [0, 1], True),
                                                      (4, [], False)])
def test_prefill_then_decode_equals_the_full_forward(streams, mix_layers, sinks):
    model = hidden_model(seed=2, streams=streams, mix_layers=mix_layers, attn_sinks=sinks)
    if sinks:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".sink"):
                    torch.nn.init.normal_(p, 0.0, 0.5)  # random, so that a sink left out fails
    seqs = [torch.randint(1, V, (k,)).tolist() for k in (11, 6, 9)]
    assert_matches_full_forward(model, seqs, prompt_lens=[3, 2, 7])


def test_a_decode_step_appends_the_new_tokens_n_streams():
    n, slots = 3, 2
    model = hidden_model(streams=n, mix_layers=[1])
    eng = Engine(model, slots=slots, max_len=32)
    assert eng.cache.k0.shape[0] == n * slots  # n cache rows (entries per token) per sequence
    eng.prefill([1], [[5, 6, 7]], [SamplingParams(max_new_tokens=4, temperature=0)])
    for visit in range(model.cfg.n_layers):
        k, _ = eng.cache.layer(visit)
        rows = [s * slots + 1 for s in range(n)]  # sequence 1's streams
        filled = k[rows].abs().sum(dim=(1, 3))  # [n, max_len]: the 3 tokens, padded to a 16-slot bucket
        assert bool((filled[:, :16] > 0).all()) and bool((filled[:, 16:] == 0).all())
        # the streams hold different keys (their own embeddings), and sequence 0 nothing
        assert not torch.allclose(k[rows[0], :, :3], k[rows[-1], :, :3])
        assert torch.count_nonzero(k[[s * slots for s in range(n)]]) == 0
    before = eng.cache.k1.clone()
    eng.step(greedy=True)
    written = (eng.cache.k1 != before).any(dim=(1, 3))  # [n * slots, max_len]
    for s in range(n):
        assert bool(written[s * slots + 1, 3]) and int(written[s * slots + 1].sum()) == 1


def test_engine_greedy_equals_uncached_greedy_and_bench_runs():
    model = hidden_model(seed=3, streams=2, mix_layers=[0, 1])
    prompts = [[3, 4, 5, 6], [7, 8]]
    new = 7
    got = [r.tokens for r in Engine(model, slots=3, max_len=32).generate(
        prompts, SamplingParams(max_new_tokens=new, temperature=0))]
    for prompt, tokens in zip(prompts, got):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(new):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert tokens == seq[len(prompt):]
    result = bench_decode(model, batch=2, context=8, steps=3)  # what `archlab bench` runs
    assert result.ms_per_step > 0 and result.tokens_per_s > 0


# ---- accounting ----------------------------------------------------------------------------------------
def test_accounting_counts_every_stream_and_the_mixing_keys():
    n, s, ctx_len, batch = 3, 16, 20, 2
    base_cfg = tiny_model_cfg(n_layers=3)
    cfg = hidden_cfg(streams=n, mix_layers=[1], n_layers=3)
    base_parts = accounting.parts(base_cfg)
    head = next(p.cost.flops for p in base_parts if p.name == "head")
    linear = sum(p.runs * p.cost.flops for p in base_parts if p.name != "head")
    per_key = [p.cost.score_flops_per_key for p in base_parts if p.name.endswith(".attn")]
    # prefill: a within-stream query at token t sees t + 1 keys, a mixing one at p = t*n + s sees p + 1
    keys = [(n * sum(t + 1 for t in range(s)) if layer != 1 else sum(p + 1 for p in range(n * s))) / s
            for layer in range(3)]
    prefill = n * linear + head + sum(k * c for k, c in zip(keys, per_key))
    assert accounting.prefill_flops_per_token(cfg, s) == pytest.approx(prefill, rel=1e-12)
    assert accounting.train_flops_per_token(cfg, s) == pytest.approx(3 * prefill, rel=1e-12)
    # decode at context C: C keys per stream; a mixing query of stream j sees (C - 1) n + j + 1
    keys = [n * ctx_len if layer != 1 else sum((ctx_len - 1) * n + j + 1 for j in range(n)) for layer in range(3)]
    decode = n * linear + head + sum(k * c for k, c in zip(keys, per_key))
    assert accounting.decode_flops_per_token(cfg, ctx_len) == pytest.approx(decode, rel=1e-12)
    kv = accounting.kv_bytes_per_token(base_cfg)
    assert accounting.kv_bytes_per_token(cfg) == n * kv
    d = base_cfg.d_model
    extra_reads = batch * (n - 1) * d * 2  # one row of each hidden table per sequence
    extra_kv = batch * (ctx_len + 1) * (n - 1) * kv
    assert accounting.decode_bytes_per_step(cfg, ctx_len, batch) == (
        accounting.decode_bytes_per_step(base_cfg, ctx_len, batch) + extra_reads + extra_kv)
    counts, base_counts = accounting.param_counts(cfg), accounting.param_counts(base_cfg)
    assert counts["params_total"] - base_counts["params_total"] == (n - 1) * V * d
    assert counts["params_active"] - base_counts["params_active"] == (n - 1) * V * d  # every stream runs
    assert accounting.costs(cfg, s)["kv_bytes_per_token"] == n * kv  # what `archlab info` prints


def test_one_stream_costs_the_baseline():
    base, one = tiny_model_cfg(), hidden_cfg(streams=1, mix_layers=[0])
    assert accounting.costs(one, 32) == accounting.costs(base, 32)


# ---- options -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("streams,mix_layers,match", [(0, None, "streams"), (65, None, "streams"),
                                                      (2, [2], "not layer indices"), (2, [1, 1], "twice")])
def test_bad_options_are_one_config_error(streams, mix_layers, match):
    with pytest.raises(ConfigError, match=match) as e:
        hidden_cfg(streams, mix_layers)
    assert "\n" not in str(e.value) and "model.hidden_decoding" in str(e.value)


def test_layer_dropout_cannot_split_a_tokens_streams():
    cfg = tiny_model_cfg(schedule="layer_dropout")
    cfg.hidden_decoding.enabled = True
    with pytest.raises(ConfigError, match="layer_dropout"):
        cfg.validate()


def test_default_mixing_layer_is_the_middle_one():
    assert hidden_cfg(n_layers=4).hidden_decoding.mixing(4) == {2}
    assert hidden_cfg(n_layers=3, mix_layers=[]).hidden_decoding.mixing(3) == set()


# ---- composition -----------------------------------------------------------------------------------
COMPOSED = {
    "moe": ["model.ffn=moe", "model.moe.n_experts=4", "model.moe.top_k=2"],
    "mhar": ["model.residual.kind=attnres", "model.residual.heads=4"],
    "discoloop": ["model.tie_embeddings=true", "model.schedule=looped", "model.looped.loops=2",
                  "model.looped.channel=disco"],
    "prism": ["model.heads=prism", "model.prism.head_dims=[16,8]"],
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_hidden_composes_trains_and_decodes_exactly(name):
    from archlab.config import make_config

    run = make_config("tiny", overrides=["model.vocab_size=97", "model.d_model=32", "model.n_layers=2",
                                         "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
                                         "train.seq_len=16", "model.hidden_decoding.enabled=true",
                                         "model.hidden_decoding.streams=3", *COMPOSED[name]])
    torch.manual_seed(0)
    model = build_model(run.model)
    assert accounting.costs(run.model, 16)["params_total"] == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, V, (2, 12))
    loss = model(x, x).loss
    loss.backward()
    assert torch.isfinite(loss) and model.stream_emb.weight.grad.abs().sum() > 0
    seqs = [torch.randint(1, V, (k,)).tolist() for k in (9, 5)]
    assert_matches_full_forward(model.eval(), seqs, prompt_lens=[3, 2], atol=2e-5)
