"""Variable width (><former): the schedule, the parameter match, truncate/refill against a
hand-written reference, depth routing across widths, and the FLOP and KV savings."""

from __future__ import annotations

import pytest
import torch

from archlab.config import make_config
from archlab.errors import ConfigError
from archlab.kernels.routing_reference import route_reference
from archlab.model import build_model
from archlab.model.accounting import costs, param_counts, per_layer
from archlab.model.core.context import Context
from archlab.model.core.residual import resize_stream
from archlab.model.core.spec import base_width, layer_specs
from archlab.model.variants.width.module import schedule



def small(*extra: str):
    return make_config("tiny", overrides=["model.vocab_size=97", "model.d_model=64", "model.n_layers=5",
                                          "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
                                          "train.seq_len=32", "model.width=variable",
                                          "model.variable_width.head_dim=8", "model.variable_width.multiple_of=16",
                                          *extra]).model


def test_schedule_shrinks_to_three_quarters_then_grows():
    w = schedule(12, 896, 0.5, 0.75, 32)
    b = w.index(min(w))
    assert b == round(0.75 * 11) and w[0] == w[-1] == 896 and min(w) == 448
    assert all(x % 32 == 0 for x in w)
    assert all(a >= c for a, c in zip(w[:b], w[1:b + 1])) and all(a <= c for a, c in zip(w[b:], w[b + 1:]))
    # geometric: every width is the rounded W * r^(l/b) before the bottleneck
    assert w[:b + 1] == [round(896 * 0.5 ** (l / b) / 32) * 32 for l in range(b + 1)]


@pytest.mark.parametrize("preset", ["20m", "124m"])
def test_base_width_is_the_closest_parameter_match(preset):
    uniform = param_counts(make_config(preset).model)["params_total"]
    cfg = make_config(preset, overrides=["model.width=variable"]).model
    w = base_width(cfg)
    gap = abs(param_counts(cfg)["params_total"] - uniform)
    for other in (w - 32, w + 32):  # no neighbouring multiple of 32 is closer
        o = make_config(preset, overrides=["model.width=variable", f"model.variable_width.base_width={other}"]).model
        assert abs(param_counts(o)["params_total"] - uniform) >= gap
    assert gap / uniform < 0.07


def test_heads_follow_the_width_and_keep_the_group():
    specs = layer_specs(small())
    assert [s.n_heads for s in specs] == [s.d // 8 for s in specs]
    assert all(s.head_dim == 8 and s.n_heads == 2 * s.n_kv_heads for s in specs)


def test_resize_truncates_and_refills_from_the_latest_wide_enough_state():
    seen: list[torch.Tensor] = []
    x0 = torch.arange(8.0)[None]  # width 8
    x1 = resize_stream(x0, 4, seen)  # truncate
    assert torch.equal(x1, x0[:, :4])
    x2 = resize_stream(x1 + 100, 6, seen)  # refill coordinates 4, 5 from x0 (the latest with >= 6)
    assert torch.equal(x2, torch.tensor([[100.0, 101, 102, 103, 4, 5]]))
    x3 = resize_stream(x2 + 1000, 8, seen)  # 6, 7: x0 again (x2 is only 6 wide)
    assert torch.equal(x3[0, 6:], x0[0, 6:]) and torch.equal(x3[0, :6], x2[0] + 1000)
    assert torch.equal(resize_stream(torch.ones(1, 2), 4, [])[0, 2:], torch.zeros(2))  # none wide enough


def test_standard_model_equals_a_hand_written_reference():
    torch.manual_seed(0)
    model = build_model(small()).eval()
    x = torch.randint(0, 97, (2, 11))
    ctx = Context(rope=model.position.tables(11))
    with torch.no_grad():
        h = model.tok_emb(x)
        history = []
        for block in model.layers:
            w = block.attn.wqkv.weight.shape[1]
            if w < h.shape[-1]:
                history.append(h)
                h = h[..., :w]
            elif w > h.shape[-1]:
                history.append(h)
                src = [s for s in history if s.shape[-1] >= w][-1]
                h = torch.cat([h, src[..., h.shape[-1]:w]], -1)
            h = h + block.attention(h, ctx)
            h = h + block.feed_forward(h, ctx)
        ref = model.lm_head(model.norm(h))
        assert torch.allclose(model(x).logits, ref, atol=1e-6, rtol=0)
    assert len({b.attn.wqkv.weight.shape[1] for b in model.layers}) > 2


@pytest.mark.parametrize("heads", [1, 2])
def test_depth_routing_reads_every_source_at_the_layers_width(heads):
    """AttnRes across widths: a read at width w routes over each source's first w coordinates
    (narrower sources are zero beyond their width), with the first w entries of query and gain."""
    torch.manual_seed(1)
    model = build_model(small("model.residual.kind=attnres", f"model.residual.heads={heads}")).eval()
    res = model.residual
    with torch.no_grad():
        for q in res.queries:
            q.normal_()
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad(), res.recording(sources=True) as rec:
        model(x)
    widths = [b.attn.wqkv.weight.shape[1] for b in model.layers]
    assert res.d == model.base_width == max(widths) > min(widths)
    zero_filled = 0
    for (_, site), r in rec.records.items():
        (sources, read, _), = r.captured  # the sources as the read saw them
        w = widths[site // 2] if site < res.n_sites else widths[-1]
        assert sources.shape[-1] == read.shape[-1] == w
        for label, src in zip(r.labels, sources):  # a narrower writer's source is zero beyond its width
            own = res.d if label == "emb" else widths[int(label[1:].split(".")[0])]
            if own < w:
                assert torch.count_nonzero(src[:, own:]) == 0 and torch.count_nonzero(src[:, :own]) > 0
                zero_filled += 1
        want = route_reference(sources, res.queries[site][:w], res.gains[site][:w], heads, res.eps)
        torch.testing.assert_close(read, want, atol=1e-5, rtol=1e-5)
    assert zero_filled > 0


def test_flop_and_kv_savings_show_in_the_accounting():
    u, v = make_config("124m").model, make_config("124m", overrides=["model.width=variable"]).model
    cu, cv = costs(u, 1024), costs(v, 1024)
    assert cv["train_flops_per_token"] < 0.95 * cu["train_flops_per_token"]
    assert cv["kv_bytes_per_token"] < 0.9 * cu["kv_bytes_per_token"]
    rows = per_layer(v, 1024)
    assert [r["width"] for r in rows] == [s.d for s in layer_specs(v)]
    assert sum(r["kv_bytes_per_token"] for r in rows) == cv["kv_bytes_per_token"]
    assert min(r["prefill_flops_per_token"] for r in rows) < max(r["prefill_flops_per_token"] for r in rows)


def test_options_are_checked_and_prism_is_refused():
    with pytest.raises(ConfigError, match="model.heads: width 'variable' cannot be combined with heads 'prism'"):
        small("model.heads=prism")
    with pytest.raises(ConfigError, match="model.variable_width.bottleneck"):
        small("model.variable_width.bottleneck=0")
    with pytest.raises(ConfigError, match="model.n_layers"):
        make_config("tiny", overrides=["model.width=variable", "model.n_layers=2"])
