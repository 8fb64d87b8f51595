"""Entity-familiarity probes: does a model's MLP activity tell a name it has seen from one it has not?

``scores``: the dispersion scores (inverse participation ratio, spectral entropy), AUROC, the
selection-aware best layer and its permutation test; ``linear``: the supervised logistic probe;
``entities``: the entity set; ``run``: running a checkpoint over the set (``archlab probe familiarity``).
"""
