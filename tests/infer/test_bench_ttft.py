"""The time-to-first-token protocol: alternating pairs, fresh prompts, ratios per pair."""

from __future__ import annotations

import pytest
import torch

from archlab.config import make_config
from archlab.infer import bench
from archlab.infer.engine import Engine
from archlab.model import build_model


def test_pair_statistics_against_a_hand_computation():
    # ratios 2, 1, 4, 3: their median 2.5, quartiles (inclusive) 1.75 and 3.25
    r = bench.summarise_pairs(64, [1.0, 2.0, 1.0, 2.0], [2.0, 2.0, 4.0, 6.0])
    assert (r.pairs, r.ratio, r.ratio_iqr) == (4, 2.5, (1.75, 3.25))
    assert (r.a_ms, r.a_iqr_ms, r.b_ms, r.b_iqr_ms) == (1.5, (1.0, 2.0), 3.0, (2.0, 4.5))
    # the median of per-pair ratios, not the ratio of medians: a drift shared by a pair cancels
    drift = bench.summarise_pairs(64, [1.0, 10.0, 1.0], [1.1, 11.0, 1.1])
    assert drift.ratio == pytest.approx(1.1) and drift.b_ms / drift.a_ms == pytest.approx(1.1)
    with pytest.raises(ValueError):
        bench.summarise_pairs(64, [1.0], [1.0])


def test_the_models_alternate_on_fresh_prompts_of_one_length(monkeypatch):
    cfg = make_config("tiny", overrides=["model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                                         "model.n_kv_heads=1", "model.vocab_size=64"]).model
    torch.manual_seed(0)
    a, b = build_model(cfg).eval(), build_model(cfg).eval()
    calls: list[tuple[str, tuple[int, ...]]] = []
    real = Engine.prefill

    def recorded(engine, rows, prompts, params):
        calls.append(("a" if engine.model is a else "b", tuple(prompts[0])))
        return real(engine, rows, prompts, params)

    monkeypatch.setattr(Engine, "prefill", recorded)
    r = bench.paired_ttft(a, b, prompt=20, pairs=4, warm=1)
    assert r.pairs == 4 and r.prompt == 20 and r.ratio_iqr[0] <= r.ratio <= r.ratio_iqr[1]
    timed = calls[-8:]  # after one warm-up prefill of each
    assert [who for who, _ in timed] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    prompts = [p for _, p in timed]
    assert all(len(p) == 20 for p in prompts)
    assert all(prompts[2 * i] == prompts[2 * i + 1] for i in range(4))  # one prompt per pair
    assert len({prompts[2 * i] for i in range(4)}) == 4  # fresh each pair
