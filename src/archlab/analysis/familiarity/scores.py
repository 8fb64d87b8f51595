"""Dispersion scores of MLP activations, AUROC, selection-aware best layer and its permutation test.

Definitions (``a`` is the post-SwiGLU activation ``silu(W_gate x) * W_up x`` of one layer, the input
of its ``w_down``, a vector of the layer's hidden width ``H``):

* **Inverse participation ratio** of one activation vector: ``IPR(a) = sum_i a_i^4 / (sum_i a_i^2)^2``.
  It is 1 when one unit carries all the energy and ``1/H`` when every unit carries the same; it is
  computed on the vector of the entity mention's *last* token, the position that has read the
  whole name.
* **Spectral entropy** of the entity tokens' activation matrix ``A`` (one row per token of the
  mention, ``n x H``, not centred): with singular values ``s_k`` and ``p_k = s_k^2 / sum_j s_j^2``,
  ``S(A) = -sum_k p_k ln p_k`` in nats, between 0 (rank one, e.g. a one-token mention) and
  ``ln min(n, H)`` (energy spread evenly over as many directions as there are tokens). The
  specification names the two scores but not the matrix; taking the mention's tokens is our
  choice, and because ``S`` is bounded by ``ln n`` it partly tracks how many tokens a name takes,
  which is why the probe reports the token count's own AUROC beside it.

AUROC is the Mann-Whitney statistic from average ranks (ties count one half), with label 1 (a
known entity) the positive class: the probability that a random known entity scores above a random
unknown one. The "best layer" is never chosen on the data it is scored on: in each of ``k``
stratified folds the (layer, sign) with the highest training-fold AUROC is applied to the held-out
fold, and the reported value is the mean held-out AUROC; the permutation test repeats that whole
procedure on shuffled labels. Fabricated and obscure names take more tokens than known ones, so a
score can separate them by length alone; the stratified variants compare only names of the same
token count (and shuffle labels only among them) to take that out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def inverse_participation_ratio(a: np.ndarray) -> np.ndarray:
    """IPR over the last axis of ``a`` (a vector, or a stack of vectors); 0 for an all-zero vector,
    which has no distribution of energy to measure."""
    a = np.asarray(a, dtype=np.float64)
    sq = a * a
    total = sq.sum(-1)
    return np.divide((sq * sq).sum(-1), total * total, out=np.zeros_like(total), where=total > 0)


def spectral_entropy(matrix: np.ndarray) -> float:
    """Shannon entropy (nats) of the normalised squared singular values of ``matrix`` (rows: the
    mention's tokens, columns: hidden units); 0 for an all-zero matrix."""
    s = np.linalg.svd(np.asarray(matrix, dtype=np.float64), compute_uv=False)
    energy = s * s
    total = energy.sum()
    if total <= 0:
        return 0.0
    p = energy[energy > 0] / total
    return float(-(p * np.log(p)).sum())


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n of a 1-d array, tied values sharing the mean of the ranks they span."""
    x = np.asarray(x, dtype=np.float64)
    values, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    # The tied group of the j-th smallest distinct value spans ranks start+1 .. start+count.
    start = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return (start + (counts + 1) / 2.0)[inverse]


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (1 positive, 0 negative), rank-based."""
    labels = np.asarray(labels).astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUROC needs both classes")
    ranks = average_ranks(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def stratified_auroc(scores: np.ndarray, labels: np.ndarray, strata: np.ndarray) -> float:
    """AUROC counting only pairs within the same stratum (e.g. names of the same token count): the
    within-stratum AUROCs averaged with weights ``n_pos * n_neg``, their pair counts. Strata with one
    class only have no pairs and drop out; NaN when no stratum has both classes."""
    labels = np.asarray(labels).astype(bool)
    strata = np.asarray(strata)
    total = pairs = 0.0
    for value in np.unique(strata):
        inside = strata == value
        n_pos, n_neg = int(labels[inside].sum()), int((~labels[inside]).sum())
        if n_pos and n_neg:
            total += auroc(scores[inside], labels[inside]) * n_pos * n_neg
            pairs += n_pos * n_neg
    return total / pairs if pairs else float("nan")


def auroc_per_column(scores: np.ndarray, labels: np.ndarray, strata: np.ndarray | None = None) -> np.ndarray:
    """``auroc`` (or ``stratified_auroc`` within ``strata``) of every column of ``scores`` [n, L]."""
    if strata is None:
        return np.array([auroc(scores[:, j], labels) for j in range(scores.shape[1])])
    return np.array([stratified_auroc(scores[:, j], labels, strata) for j in range(scores.shape[1])])


def stratified_folds(labels: np.ndarray, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``k`` disjoint index sets covering every item, each class dealt round-robin after a shuffle
    so every fold holds both classes in about the overall proportion."""
    labels = np.asarray(labels)
    folds: list[list[int]] = [[] for _ in range(k)]
    offset = 0
    for value in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == value))
        for i, idx in enumerate(members):
            folds[(i + offset) % k].append(int(idx))
        offset += len(members)  # the next class starts where this one stopped, evening fold sizes
    return [np.array(sorted(f)) for f in folds]


@dataclass
class SelectedLayer:
    """The selection-aware result: mean held-out AUROC, and per fold the layer and sign chosen on
    its training folds (sign -1: lower scores mean known) and the held-out AUROC."""

    auroc: float
    layers: list[int]
    signs: list[int]
    fold_aurocs: list[float]


def select_layer_cv(scores: np.ndarray, labels: np.ndarray, folds: list[np.ndarray],
                    strata: np.ndarray | None = None) -> SelectedLayer:
    """For each fold, the (layer, sign) with the best AUROC on the other folds, scored on it; with
    ``strata``, every AUROC is the within-stratum one."""
    labels = np.asarray(labels)
    n = len(labels)
    layers, signs, held = [], [], []
    for test in folds:
        train = np.setdiff1d(np.arange(n), test)
        train_auc = auroc_per_column(scores[train], labels[train], None if strata is None else strata[train])
        train_auc = np.nan_to_num(train_auc, nan=0.5)
        # A score's direction is not known in advance, so it is chosen on the training folds too;
        # 1 - AUROC is the AUROC of the negated score.
        oriented = np.maximum(train_auc, 1.0 - train_auc)
        layer = int(np.argmax(oriented))
        sign = 1 if train_auc[layer] >= 0.5 else -1
        layers.append(layer)
        signs.append(sign)
        column = sign * scores[test, layer]
        held.append(auroc(column, labels[test]) if strata is None
                    else stratified_auroc(column, labels[test], strata[test]))
    # A held-out fold whose strata each hold one class only has no within-stratum pair: NaN, left out.
    valid = [a for a in held if not np.isnan(a)]
    return SelectedLayer(float(np.mean(valid)) if valid else float("nan"), layers, signs, [float(a) for a in held])


@dataclass
class PermutationTest:
    """The observed selection-aware AUROC against the same procedure on shuffled labels."""

    observed: SelectedLayer
    null: np.ndarray
    p_value: float

    @property
    def floor(self) -> float:
        """The 95th percentile of the null: what selection alone reaches without a signal."""
        finite = self.null[~np.isnan(self.null)]
        return float(np.quantile(finite, 0.95)) if finite.size else float("nan")


def shuffle_within(labels: np.ndarray, strata: np.ndarray | None, rng: np.random.Generator) -> np.ndarray:
    """``labels`` permuted, within each stratum when ``strata`` is given (keeping each stratum's
    class counts, so the null keeps whatever the strata alone explain)."""
    if strata is None:
        return rng.permutation(labels)
    out = labels.copy()
    for value in np.unique(strata):
        inside = np.flatnonzero(strata == value)
        out[inside] = rng.permutation(labels[inside])
    return out


def permutation_test(scores: np.ndarray, labels: np.ndarray, k: int = 5, n_permutations: int = 200,
                     seed: int = 0, strata: np.ndarray | None = None) -> PermutationTest:
    """Empirical p-value ``(1 + #{null >= observed}) / (1 + n_permutations)`` of the selection-aware
    AUROC; each shuffled label set gets its own folds, drawn as the observed ones are. With
    ``strata`` the AUROCs are within-stratum and labels are shuffled within strata."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    observed = select_layer_cv(scores, labels, stratified_folds(labels, k, rng), strata)
    null = np.empty(n_permutations)
    for i in range(n_permutations):
        shuffled = shuffle_within(labels, strata, rng)
        null[i] = select_layer_cv(scores, shuffled, stratified_folds(shuffled, k, rng), strata).auroc
    if np.isnan(observed.auroc):
        return PermutationTest(observed, null, 1.0)
    # A shuffle whose AUROC cannot be computed (NaN) counts as reaching the observed value: the
    # conservative side.
    p = (1 + int(((null >= observed.auroc) | np.isnan(null)).sum())) / (1 + n_permutations)
    return PermutationTest(observed, null, float(p))
