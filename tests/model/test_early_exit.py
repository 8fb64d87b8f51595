"""Early exit (``exit_after``): at the last visit it is the full model; at L it is the model
truncated to L layers; cached prefill/decode that exit equal the full forward that exits, and
write exactly the full model's cache entries for the visits they run; every exit in one run
(``on_exit``) equals one forward per exit; exits are refused where the width differs."""

from __future__ import annotations

import pytest
import torch

from archlab.config import make_config
from archlab.model import build_model

V, D, L = 97, 32, 4
MODELS = {
    "baseline": [],
    "looped": ["model.schedule=looped", "model.looped.prelude=1"],
    "branch": ["model.branch.enabled=true"],
    "attnres": ["model.residual.kind=attnres", "model.residual.blocks=3"],
    "delta": ["model.residual.kind=delta", "model.residual.heads=2"],
}


def built(*overrides: str, layers: int = L, seed: int = 0):
    torch.manual_seed(seed)
    cfg = make_config("tiny", overrides=[f"model.vocab_size={V}", f"model.d_model={D}", f"model.n_layers={layers}",
                                         "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
                                         "train.seq_len=32", *overrides]).model
    model = build_model(cfg)
    with torch.no_grad():  # zero-initialised routing queries and coupling vectors made to matter
        for name, p in model.named_parameters():
            if name.startswith("residual.") or ".couple_" in name:
                p.add_(0.5 * torch.randn_like(p))
    return model.eval()


def tokens(batch: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MODELS))
def test_an_exit_after_the_last_visit_is_the_full_model(name):
    model = built(*MODELS[name])
    x = tokens()
    with torch.no_grad():
        full, exited = model(x), model(x, exit_after=len(model.visits))
    assert torch.equal(full.logits, exited.logits)
    assert (full.extra_logits is None) == (exited.extra_logits is None)
    if full.extra_logits is not None:
        assert torch.equal(full.extra_logits, exited.extra_logits)


@pytest.mark.parametrize("exit_after", [1, 2, 3])
def test_an_exit_after_l_layers_is_the_model_truncated_to_l_layers(exit_after):
    model = built()
    short = built(layers=exit_after)
    short.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("layers.") or int(k.split(".")[1]) < exit_after})
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x, exit_after=exit_after).logits, short(x).logits, rtol=0, atol=0)
        assert not torch.allclose(model(x, exit_after=exit_after).logits, model(x).logits, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_decoding_with_an_exit_equals_the_forward_with_that_exit(name):
    model = built(*MODELS[name])
    n = len(model.visits)
    exit_after = n // 2
    x = tokens(2, 10)
    prompt = 6
    with torch.no_grad():
        ref = model.log_probs(model(x, exit_after=exit_after))
        cache, full_cache = model.new_cache(2, 16), model.new_cache(2, 16)
        lengths = torch.tensor([prompt, prompt])
        got = [model.prefill(x[:, :prompt], cache, lengths, exit_after=exit_after)]
        model.prefill(x[:, :prompt], full_cache, lengths)
        for t in range(prompt, x.shape[1]):
            got.append(model.decode(x[:, t:t + 1], cache, torch.tensor([t, t]), exit_after=exit_after))
            model.decode(x[:, t:t + 1], full_cache, torch.tensor([t, t]))
    for j, lp in enumerate(got):
        torch.testing.assert_close(lp, ref[:, prompt - 1 + j], rtol=0, atol=1e-5)
    for visit in range(n):  # the visits run write the full model's entries; the others nothing
        for mine, full in zip(cache.layer(visit), full_cache.layer(visit)):
            if visit < exit_after:
                torch.testing.assert_close(mine[:, :, :x.shape[1]], full[:, :, :x.shape[1]], rtol=0, atol=1e-6)
            else:
                assert not mine.any()


@pytest.mark.parametrize("name", ["baseline", "looped", "attnres", "delta"])
def test_every_exit_in_one_run_equals_one_forward_per_exit(name):
    from archlab.model.core.context import Context

    model = built(*MODELS[name])
    x = tokens()
    seen = {}
    with torch.no_grad():
        ctx = Context(rope=model.position.tables(x.shape[1]))
        last = model.run(model.tok_emb(x), ctx, on_exit=lambda visit, h: seen.setdefault(visit + 1, model.logits(h)))
        assert sorted(seen) == model.exit_points == list(range(1, len(model.visits) + 1))
        for n, logits in seen.items():
            torch.testing.assert_close(logits, model(x, exit_after=n).logits, rtol=0, atol=1e-6)
        assert torch.equal(model.logits(last), seen[len(model.visits)])


def test_exits_are_where_the_state_has_the_final_width():
    model = built("model.width=variable", "model.variable_width.multiple_of=16")
    final = model.widths[model.visits[-1]]
    assert model.exit_points == [n for n in range(1, L + 1) if model.widths[n - 1] == final]
    assert len(model.exit_points) < L
    narrow = next(n for n in range(1, L + 1) if n not in model.exit_points)
    with pytest.raises(ValueError, match=f"exit_after={narrow}"):
        model(tokens(), exit_after=narrow)
    with pytest.raises(ValueError, match="exit_after=0"):
        built()(tokens(), exit_after=0)
