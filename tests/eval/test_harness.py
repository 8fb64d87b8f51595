"""The scorer and the metrics: known answers, normalisation, standard errors, batching, truncation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from archlab.errors import DataError
from archlab.eval.harness import (Score, Scorer, byte_len, choice_len, evaluate, evaluate_lambada, evaluate_mc, stderr)
from archlab.eval.tasks import LambadaItem, MCItem
from tests.eval.conftest import lambada_items, mc_items


# ---- a model that knows the answers ----------------------------------------------------------------
def test_multiple_choice_known_answers(trained_model, tokenizer, words):
    items = mc_items(words)
    assert len(items) == 14 and {it.gold for it in items} == {0, 1, 2}
    scorer = Scorer(trained_model, tokenizer, batch_size=5)
    res = evaluate_mc(items, scorer)
    assert res["n"] == 14
    assert res["acc"] == 1.0 and res["acc_norm"] == 1.0 and res["acc_stderr"] == 0.0
    # the same items with a wrong gold: every answer now counts as wrong
    wrong = [MCItem(it.context, it.continuations, (it.gold + 1) % 3) for it in items]
    res = evaluate_mc(wrong, scorer)
    assert res["acc"] == 0.0 and res["acc_norm"] == 0.0


def test_lambada_known_answers(trained_model, tokenizer, words):
    items = lambada_items(words)
    scorer = Scorer(trained_model, tokenizer, batch_size=3)
    assert max(len(scorer.encode(" " + it.target)) for it in items) >= 3  # multi-token words too
    res = evaluate_lambada(items, scorer)
    assert res["acc"] == 1.0 and res["n"] == 16
    assert res["ppl"] < 1.2
    res = evaluate_lambada(lambada_items(words, shift=5), scorer)
    assert res["acc"] == 0.0 and res["ppl"] > 10


# ---- the scorer against a direct computation ---------------------------------------------------------
def _manual(model, ctx: list[int], cont: list[int], max_len: int) -> tuple[float, bool]:
    seq = (ctx + cont)[-(max_len + 1):]
    x = torch.tensor([seq[:-1]])
    with torch.no_grad():
        logp = F.log_softmax(model(x).logits[0].float(), -1)
    n = len(cont)
    tgt = torch.tensor(seq[1:][-n:])
    rows = logp[-n:]
    return float(rows[torch.arange(n), tgt].sum()), bool((rows.argmax(-1) == tgt).all())


@pytest.fixture(scope="module")
def random_model(tokenizer):
    from archlab.model import build_model
    from tests.helpers import tiny_model_cfg

    torch.manual_seed(1)
    return build_model(tiny_model_cfg(vocab_size=tokenizer.get_vocab_size(), max_seq_len=16)).eval()


def test_scorer_matches_direct_forward_and_batching(random_model, tokenizer, sentence):
    pairs = [(sentence[:i], sentence[i:i + 7 + i % 5]) for i in range(3, 60, 8)] + [("", "This")]
    pairs += [(sentence[:30] + " ", "x y")]  # trailing space moves to the continuation
    s1 = Scorer(random_model, tokenizer, batch_size=1)(pairs)
    s4 = Scorer(random_model, tokenizer, batch_size=4)(pairs)
    scorer = Scorer(random_model, tokenizer)
    for (ctx, cont), a, b in zip(pairs, s1, s4):
        c_ids, x_ids = scorer.encode_pair(ctx, cont)
        lp, greedy = _manual(random_model, c_ids, x_ids, 16)
        assert a.logprob == pytest.approx(lp, abs=1e-4)
        assert b.logprob == pytest.approx(lp, abs=1e-4)
        assert a.greedy == greedy == b.greedy
        assert a.n_tokens == len(x_ids)
    ctx_ids, cont_ids = scorer.encode_pair(sentence[:30] + " ", "x y")
    assert tokenizer.decode(cont_ids) == " x y"
    assert scorer.encode_pair("", "This")[0] == [0]  # empty context: <|endoftext|>


def test_left_truncation_keeps_the_continuation(random_model, tokenizer, sentence):
    scorer = Scorer(random_model, tokenizer)
    ctx = sentence  # far more than the model's 16 positions
    cont = " set, and"
    c_ids, x_ids = scorer.encode_pair(ctx, cont)
    assert len(c_ids) > 30
    (s,) = scorer([(ctx, cont)])
    lp, _ = _manual(random_model, c_ids, x_ids, 16)
    assert s.logprob == pytest.approx(lp, abs=1e-4)
    # and it is not what the untruncated-but-shifted context would give
    lp_short, _ = _manual(random_model, c_ids[-3:], x_ids, 16)
    assert abs(s.logprob - lp_short) > 1e-3


def test_empty_continuation_is_an_error(random_model, tokenizer):
    with pytest.raises(DataError, match="no tokens"):
        Scorer(random_model, tokenizer)([("This module", "")])


# ---- metrics with a stub log-likelihood ------------------------------------------------------------
def stub(table: dict[tuple[str, str], float], greedy: dict | None = None):
    def ll(requests):
        return [Score(table[r], (greedy or {}).get(r, False), 1) for r in requests]
    return ll


def test_acc_norm_is_lm_evals_per_character_and_per_byte_is_its_own_metric():
    # The leading space decides: per character of the choice (lm-eval, no space) " abcd" wins,
    # -3.5/4 = -0.875 > -2/2 = -1.0; per byte as scored (space included) " ab" wins, -2/3 > -3.5/5.
    space = MCItem("Q:", (" ab", " abcd"), gold=1)
    # Characters against bytes: per character " abcd" wins (-3.2/4 = -0.8 > -3/3 = -1.0); per
    # UTF-8 byte " ééé" (7 bytes) wins (-3/7 = -0.43 > -3.2/5 = -0.64).
    accents = MCItem("Q:", (" ééé", " abcd"), gold=1)
    # raw log-likelihood prefers the short choice, per character the long one
    long = MCItem("Q:", (" a", " abcdefgh"), gold=1)
    table = {("Q:", " ab"): -2.0, ("Q:", " abcd"): -3.5}
    res = evaluate_mc([space], stub(table))
    assert (res["acc"], res["acc_norm"], res["acc_per_byte"]) == (0.0, 1.0, 0.0)
    table = {("Q:", " ééé"): -3.0, ("Q:", " abcd"): -3.2}
    res = evaluate_mc([accents], stub(table))
    assert (res["acc"], res["acc_norm"], res["acc_per_byte"]) == (0.0, 1.0, 0.0)
    table = {("Q:", " a"): -1.0, ("Q:", " abcdefgh"): -2.0}
    res = evaluate_mc([long], stub(table))
    assert (res["acc"], res["acc_norm"], res["acc_per_byte"]) == (0.0, 1.0, 1.0)
    assert choice_len(" ééé") == 3 and choice_len("abc") == 3 and choice_len("  x") == 2
    assert byte_len(" ééé") == 7 and byte_len("x", "ctx\n ") == 3  # trailing context whitespace counts


def test_mc_records_hold_every_choice_and_pick():
    item = MCItem("Q:", (" ab", " abcd"), gold=1)
    records: list = []
    evaluate_mc([item], stub({("Q:", " ab"): -2.0, ("Q:", " abcd"): -3.5}), records)
    assert records == [{"loglikelihoods": [-2.0, -3.5], "greedy": [False, False], "pred": 0, "pred_norm": 1,
                         "pred_per_byte": 0, "gold": 1}]


def test_per_choice_contexts_are_scored_each_with_their_own():
    item = MCItem("The cat sat on the ", (" sat.", " sat."), gold=1, contexts=("The mat", "The cat"))
    table = {("The mat", " sat."): -5.0, ("The cat", " sat."): -1.0}
    assert evaluate_mc([item], stub(table))["acc"] == 1.0


def test_accuracy_standard_error():
    items = [MCItem(f"q{i}", (" yes", " no"), gold=0 if i < 3 else 1) for i in range(4)]
    table = {(f"q{i}", " yes"): -1.0 for i in range(4)} | {(f"q{i}", " no"): -2.0 for i in range(4)}
    res = evaluate_mc(items, stub(table))  # always answers " yes": 3 of 4 right
    assert res["acc"] == 0.75 and res["n"] == 4
    assert res["acc_stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert res["acc_norm_stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert stderr(1.0, 10) == 0.0 and stderr(0.5, 100) == pytest.approx(0.05)


def test_lambada_metrics_from_stub():
    items = [LambadaItem(f"passage {i}", "word") for i in range(4)]
    table = {(f"passage {i}", " word"): -float(i) for i in range(4)}
    greedy = {(f"passage {i}", " word"): i != 2 for i in range(4)}
    res = evaluate_lambada(items, stub(table, greedy))
    assert res["acc"] == 0.75
    assert res["acc_stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert res["ppl"] == pytest.approx(math.exp(1.5))


# ---- the public entry point ------------------------------------------------------------------------
def test_evaluate_entry_point_reads_files_and_limits(trained_model, tokenizer, words, tmp_path):
    import json

    mc = tmp_path / "mc.jsonl"
    mc.write_text("".join(json.dumps({"context": it.context, "continuations": list(it.continuations),
                                      "gold": it.gold}) + "\n" for it in mc_items(words)))
    lam = tmp_path / "lambada.jsonl"
    lam.write_text(json.dumps({"context": "This module implements specialized", "target": "container"}) + "\n")
    res = evaluate(trained_model, tokenizer, f"piqa={mc},lambada={lam}", limit=5, batch_size=4)
    assert set(res) == {"piqa", "lambada"}
    assert res["piqa"]["n"] == 5 and res["piqa"]["acc"] == 1.0
    assert res["lambada"]["n"] == 1 and res["lambada"]["acc"] == 1.0
    assert set(res["piqa"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "acc_per_byte",
                                "acc_per_byte_stderr", "n"}
    assert set(res["lambada"]) == {"acc", "acc_stderr", "ppl", "n"}
