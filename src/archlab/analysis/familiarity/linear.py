"""The supervised baseline: an L2-regularised logistic regression on one layer's activations,
cross-validated, and its layer chosen by inner cross-validation on the training folds only.

The fit minimises ``sum_i logloss_i + ||w||^2 / (2C)`` (the bias unpenalised), the objective
scikit-learn's ``LogisticRegression(C=C)`` minimises, in float64 by Newton's method. Features are
standardised with the training fold's mean and spread, so one ``C`` suits every layer whatever
its activation scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from archlab.analysis.familiarity.scores import auroc, stratified_folds


def _objective(theta: np.ndarray, z: np.ndarray, y: np.ndarray, penalty: np.ndarray) -> float:
    logits = z @ theta
    return float(np.logaddexp(0.0, logits).sum() - y @ logits + 0.5 * (penalty * theta * theta).sum())


def fit_logistic(x: np.ndarray, y: np.ndarray, c: float = 0.1, max_iter: int = 100,
                 tol: float = 1e-10) -> tuple[np.ndarray, float]:
    """Weights and bias of the L2 logistic regression of labels ``y`` (0/1) on rows ``x``.

    The optimal weights lie in the span of the rows (the penalty removes any component outside
    it), so with ``x = U S V^T`` the problem is solved for ``w = V z`` in the rank-``r`` coordinates
    ``U S``: Newton steps on ``r + 1`` unknowns however wide the layer is, which is what makes a
    probe per layer and fold affordable on a CPU. Directions with singular value below 1e-7 of the
    largest are dropped (the Gram matrix squares the condition number, so its tiny eigenvalues are
    noise)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    # U and S from the n x n Gram matrix (an eigendecomposition of X X^T is far cheaper than an SVD
    # of the n x H matrix when H is thousands); V = X^T U / S.
    eigval, u = np.linalg.eigh(x @ x.T)
    s = np.sqrt(np.clip(eigval, 0.0, None))
    keep = s > s.max() * 1e-7 if s.size and s.max() > 0 else np.zeros_like(s, dtype=bool)
    z = np.hstack([u[:, keep] * s[keep], np.ones((len(y), 1))])
    penalty = np.append(np.full(int(keep.sum()), 1.0 / c), 0.0)  # the bias is not penalised
    theta = np.zeros(z.shape[1])
    loss = _objective(theta, z, y, penalty)
    for _ in range(max_iter):
        p = 1.0 / (1.0 + np.exp(-(z @ theta)))
        grad = z.T @ (p - y) + penalty * theta
        hess = (z * (p * (1.0 - p))[:, None]).T @ z + np.diag(penalty)
        step = np.linalg.solve(hess + 1e-12 * np.eye(len(theta)), grad)
        t = 1.0
        # Backtracking keeps every step a descent step when the data are (nearly) separable.
        while t > 1e-8:
            trial = theta - t * step
            trial_loss = _objective(trial, z, y, penalty)
            if trial_loss <= loss:
                break
            t *= 0.5
        theta, improvement, loss = trial, loss - trial_loss, trial_loss
        if improvement <= tol * max(1.0, abs(loss)):
            break
    v = x.T @ u[:, keep] / s[keep]
    return v @ theta[:-1], float(theta[-1])


def _standardise(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    mean = train.mean(0)
    std = train.std(0)
    std[std == 0] = 1.0  # a unit that never varies carries no information; keep it at zero
    return [(a - mean) / std for a in (train, *others)]


def held_out_logits(x: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray, c: float) -> np.ndarray:
    """Logits on ``test`` of the probe fitted on ``train``."""
    xtr, xte = _standardise(x[train], x[test])
    w, b = fit_logistic(xtr, y[train], c)
    return xte @ w + b


@dataclass
class ProbeScore:
    """Mean over held-out folds of accuracy (threshold 0.5) and AUROC."""

    accuracy: float
    auroc: float


def cross_validate(x: np.ndarray, y: np.ndarray, folds: list[np.ndarray], c: float = 0.1) -> ProbeScore:
    """The probe on features ``x`` [n, H], scored on each held-out fold."""
    n = len(y)
    acc, auc = [], []
    for test in folds:
        logits = held_out_logits(x, y, np.setdiff1d(np.arange(n), test), test, c)
        acc.append(float(((logits > 0) == (y[test] == 1)).mean()))
        auc.append(auroc(logits, y[test]))
    return ProbeScore(float(np.mean(acc)), float(np.mean(auc)))


@dataclass
class SelectedProbe:
    """The nested result: per outer fold the layer inner CV chose, and the held-out means."""

    score: ProbeScore
    layers: list[int]


def select_probe_layer_cv(features: list[np.ndarray], y: np.ndarray, folds: list[np.ndarray], c: float = 0.1,
                          inner_k: int = 3, seed: int = 0) -> SelectedProbe:
    """Nested cross-validation over layers: for each outer fold, the layer whose probe has the best
    inner-CV AUROC on the training folds is refitted on them and scored on the held-out fold."""
    n = len(y)
    rng = np.random.default_rng(seed)
    acc, auc, layers = [], [], []
    for test in folds:
        train = np.setdiff1d(np.arange(n), test)
        inner = [train[f] for f in stratified_folds(y[train], inner_k, rng)]
        inner_auc = []
        for x in features:
            per_fold = []
            for inner_test in inner:
                inner_train = np.setdiff1d(train, inner_test)
                per_fold.append(auroc(held_out_logits(x, y, inner_train, inner_test, c), y[inner_test]))
            inner_auc.append(np.mean(per_fold))
        layer = int(np.argmax(inner_auc))
        logits = held_out_logits(features[layer], y, train, test, c)
        layers.append(layer)
        acc.append(float(((logits > 0) == (y[test] == 1)).mean()))
        auc.append(auroc(logits, y[test]))
    return SelectedProbe(ProbeScore(float(np.mean(acc)), float(np.mean(auc))), layers)
