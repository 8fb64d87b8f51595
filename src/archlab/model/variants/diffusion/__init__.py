"""Uniform diffusion (Sumi; spec section 3, "Lower priority"): ``model.objective: uniform-diffusion``.

The same backbone trained as a denoiser instead of a next-token predictor: every token of a
sequence is independently replaced by a uniformly random token with probability ``1 - alpha(t)``,
and the model, attending in both directions and told ``t``, predicts the clean tokens. Training
minimises the continuous-time negative ELBO, an upper bound on the sequence's negative
log-likelihood, so its bits per byte is a bound (``bpb_bound``) beside the autoregressive exact
value. Sampling runs the reverse process from uniform noise (``archlab generate --diffusion-steps``).

It fills the ``rows`` slot, the slot that owns how a forward pass is arranged and what its
readout is; it is switched on by ``model.objective`` and its options are ``model.diffusion.*``.
The mathematics is in ``process``, the model side in ``module``, the sampler in ``sampler``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from archlab.model.registry import Variant, register
from archlab.typed import check

KIND = "uniform-diffusion"


@dataclass
class DiffusionConfig:
    #: alpha(t), the probability that a token is still clean at noise level t: ``linear``
    #: (1 - t; "log-linear" in total noise -log alpha) or ``cosine`` (cos(pi t / 2))
    schedule: str = "linear"
    #: noise levels of a batch: ``stratified`` (one per stratum of [0, 1), a low-discrepancy
    #: draw) or ``independent`` (uniform each)
    time_sampling: str = "stratified"
    #: the seed of the noise that evaluation draws: the bound of the same weights on the same
    #: windows is the same number every time it is measured
    eval_seed: int = 0

    #: the ``model.objective`` value that switches this rows kind on (``ModelConfig.validate``
    #: lists the objectives from this attribute)
    OBJECTIVE: ClassVar[str] = KIND

    def followers(self) -> int:
        return 0  # one row per token: no follower rows for the accounting

    def validate(self, model) -> None:
        from archlab.model.variants.diffusion.process import SCHEDULES

        check(self.schedule in SCHEDULES, "model.diffusion.schedule",
              f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        check(self.time_sampling in ("stratified", "independent"), "model.diffusion.time_sampling",
              f"must be stratified or independent, got {self.time_sampling!r}")
        check(isinstance(self.eval_seed, int) and self.eval_seed >= 0, "model.diffusion.eval_seed",
              f"must be a non-negative integer, got {self.eval_seed!r}")
        # A loop's channel, early exits and dropped layers are built around left-to-right
        # decoding and its cache; with a denoiser they are untried, so only the plain
        # schedule runs (the decode branch and Hidden Decoding are rows kinds: the registry
        # already refuses two rows kinds at once).
        check(model.schedule == "sequential", "model.schedule",
              f"model.objective {KIND} runs every layer once, in order: schedule 'sequential', got "
              f"{model.schedule!r}")


register(Variant("rows", KIND, "archlab.model.variants.diffusion.module:UniformDiffusionRows",
                 options=DiffusionConfig, section="diffusion", active=lambda cfg: cfg.objective == KIND,
                 doc="uniform-noise discrete diffusion: bidirectional denoiser, continuous-time ELBO (Sumi)"))
