"""Familiarity statistics: IPR and spectral entropy against hand-computed values, AUROC against a
hand count (and scikit-learn when installed), the selection-aware best layer finding a planted
signal, shuffled labels staying near 0.5, the permutation p, and the logistic probe against
scikit-learn's fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from archlab.analysis.familiarity.linear import cross_validate, fit_logistic, select_probe_layer_cv
from archlab.analysis.familiarity.scores import (auroc, average_ranks, inverse_participation_ratio,
                                                 permutation_test, select_layer_cv, shuffle_within,
                                                 spectral_entropy, stratified_auroc, stratified_folds)


def test_ipr_by_hand():
    assert inverse_participation_ratio(np.array([0.0, 3.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert inverse_participation_ratio(np.array([1.0, -1.0, 1.0, -1.0])) == pytest.approx(0.25)
    # (1 + 16) / (1 + 4)^2: energy 1 and 4 of 5
    assert inverse_participation_ratio(np.array([1.0, 2.0, 0.0])) == pytest.approx(17 / 25)
    rows = inverse_participation_ratio(np.array([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert rows.tolist() == pytest.approx([17 / 25, 0.0])


def test_spectral_entropy_by_hand():
    # diag(3, 4): squared singular values 9 and 16 of 25
    p = np.array([9 / 25, 16 / 25])
    assert spectral_entropy(np.array([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]])) == pytest.approx(-(p * np.log(p)).sum())
    assert spectral_entropy(np.eye(3)) == pytest.approx(math.log(3))
    # two parallel rows are one direction: rank one, no spread
    assert spectral_entropy(np.array([[1.0, 2.0, 2.0], [2.0, 4.0, 4.0]])) == pytest.approx(0.0, abs=1e-12)
    assert spectral_entropy(np.zeros((2, 3))) == 0.0
    # a rotation does not change the spectrum
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))
    m = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    assert spectral_entropy(m @ q) == pytest.approx(spectral_entropy(m))


def test_auroc_by_hand_with_ties():
    assert average_ranks(np.array([10.0, 20.0, 10.0, 30.0])).tolist() == [1.5, 3.0, 1.5, 4.0]
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.4, 0.2])
    labels = np.array([0, 0, 1, 1, 1, 0])
    # pairs (pos, neg) with pos > neg: 0.35 beats 0.1, 0.2; 0.8 beats all 3; 0.4 beats 0.1, 0.2 and
    # ties 0.4 (one half): 2 + 3 + 2.5 = 7.5 of 9
    assert auroc(scores, labels) == pytest.approx(7.5 / 9)
    assert auroc(-scores, labels) == pytest.approx(1.5 / 9)
    assert auroc(np.ones(6), labels) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        auroc(scores, np.ones(6))


def test_auroc_matches_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    for _ in range(5):
        labels = rng.integers(0, 2, 57)
        scores = rng.integers(0, 6, 57).astype(float)  # many ties
        assert auroc(scores, labels) == pytest.approx(metrics.roc_auc_score(labels, scores))


def test_stratified_auroc_by_hand_and_length_confound_removed():
    # stratum 1: pos {3}, neg {1, 5} -> 1 of 2 pairs; stratum 2: pos {4, 6}, neg {2} -> 2 of 2 pairs;
    # stratum 3 has one class and no pairs: (0.5 * 2 + 1.0 * 2) / 4
    scores = np.array([3.0, 1.0, 5.0, 4.0, 6.0, 2.0, 9.0])
    labels = np.array([1, 0, 0, 1, 1, 0, 1])
    strata = np.array([1, 1, 1, 2, 2, 2, 3])
    assert stratified_auroc(scores, labels, strata) == pytest.approx(0.75)
    assert np.isnan(stratified_auroc(scores, labels, np.arange(7)))
    # a score that is only the token count separates the classes, but not within a token count
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 4, 200)
    labels = (rng.random(200) < np.where(tokens == 1, 0.8, 0.2)).astype(int)
    score = tokens + 0.01 * rng.normal(size=200)
    assert auroc(-score, labels) > 0.7
    assert abs(stratified_auroc(-score, labels, tokens) - 0.5) < 0.12
    shuffled = shuffle_within(labels, tokens, rng)
    for t in (1, 2, 3):
        assert shuffled[tokens == t].sum() == labels[tokens == t].sum()


def test_folds_are_stratified_and_cover_every_item():
    labels = np.array([1] * 12 + [0] * 18)
    folds = stratified_folds(labels, 5, np.random.default_rng(0))
    assert sorted(np.concatenate(folds).tolist()) == list(range(30))
    assert all(0 < labels[f].sum() < len(f) for f in folds)
    assert max(map(len, folds)) - min(map(len, folds)) <= 1


def planted(n: int = 60, layers: int = 6, signal_layer: int = 4, strength: float = 2.5, seed: int = 0):
    """Noise scores [n, layers]; in ``signal_layer`` known items (label 1) score *lower*."""
    rng = np.random.default_rng(seed)
    labels = np.array([1, 0] * (n // 2))
    scores = rng.normal(size=(n, layers))
    scores[:, signal_layer] -= strength * labels
    return scores, labels


def test_planted_signal_layer_and_sign_are_found_on_training_folds():
    scores, labels = planted()
    result = select_layer_cv(scores, labels, stratified_folds(labels, 5, np.random.default_rng(0)))
    assert result.layers == [4] * 5 and result.signs == [-1] * 5
    assert result.auroc > 0.9
    test = permutation_test(scores, labels, k=5, n_permutations=99, seed=0)
    assert test.p_value == pytest.approx(0.01)  # nothing in the null reaches it: (1 + 0) / (1 + 99)
    assert test.floor < test.observed.auroc


def test_shuffled_labels_give_auroc_near_one_half():
    scores, labels = planted()
    rng = np.random.default_rng(3)
    held_out = [select_layer_cv(scores, shuffled, stratified_folds(shuffled, 5, rng)).auroc
                for shuffled in (rng.permutation(labels) for _ in range(30))]
    # Choosing the best of 12 (layer, sign) pairs on training folds does not inflate held-out AUROC.
    assert abs(np.mean(held_out) - 0.5) < 0.06
    noise = np.random.default_rng(4).normal(size=scores.shape)
    assert permutation_test(noise, labels, n_permutations=99, seed=0).p_value > 0.05


def test_permutation_p_is_reproducible_by_seed():
    scores, labels = planted(strength=0.6)
    a = permutation_test(scores, labels, n_permutations=40, seed=7)
    b = permutation_test(scores, labels, n_permutations=40, seed=7)
    assert a.p_value == b.p_value and np.array_equal(a.null, b.null)


def test_logistic_fit_matches_scikit_learn():
    linear_model = pytest.importorskip("sklearn.linear_model")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5))
    y = (x[:, 0] - 0.5 * x[:, 2] + 0.7 * rng.normal(size=40) > 0).astype(np.int64)
    w, b = fit_logistic(x, y, c=0.3)
    ref = linear_model.LogisticRegression(C=0.3, tol=1e-10, max_iter=10_000).fit(x, y)
    assert w == pytest.approx(ref.coef_[0], abs=1e-4) and b == pytest.approx(ref.intercept_[0], abs=1e-4)


def test_probe_finds_a_planted_direction_and_not_noise():
    rng = np.random.default_rng(0)
    labels = np.array([1, 0] * 30)
    features = [rng.normal(size=(60, 8)) for _ in range(3)]
    features[1][:, 3] += 2.0 * labels
    folds = stratified_folds(labels, 5, np.random.default_rng(1))
    assert cross_validate(features[1], labels, folds).auroc > 0.85
    assert abs(cross_validate(features[0], labels, folds).auroc - 0.5) < 0.2
    nested = select_probe_layer_cv(features, labels, folds)
    assert nested.layers == [1] * 5 and nested.score.accuracy > 0.75
