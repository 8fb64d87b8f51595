"""The uniform-diffusion denoiser on the one model: a ``rows`` kind whose pass attends in both
directions, whose input carries the noise level, and which scores its own training objective.

``Transformer.forward(idx, targets)`` hands the clean ``targets`` to ``objective_nll`` (the model
core's hook for a rows kind that is a training objective of its own); the trainer and the
evaluator see a ``ModelOutput`` whose ``nll`` is the ELBO estimate and whose ``nll_is_bound`` says
so. The left-to-right entry points (a forward without targets, ``prefill``, ``decode``) have no
meaning for a denoiser and are refused in one line.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archlab.errors import UsageError
from archlab.model.core.context import Context, Pass
from archlab.model.core.cost import Cost
from archlab.model.core.layers import Linear, sdpa
from archlab.model.core.spec import base_width
from archlab.model.variants.diffusion import KIND
from archlab.model.variants.diffusion.process import alpha, corrupt, elbo_integrand, sample_times
from archlab.model.variants.diffusion.sampler import ancestral_sample

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.decoder import Block, Transformer
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec

NOT_LEFT_TO_RIGHT = (f"a model.objective {KIND} model denoises whole sequences and predicts no next token; "
                     "sample it with `archlab generate --diffusion-steps N` and score it with `archlab eval` "
                     "(an upper bound)")


class BidirectionalPass(Pass):
    """Every row is primary, and every position attends to every position of its sequence."""

    def attend(self, visit: int, attention, q: Tensor, k: Tensor, v: Tensor, ctx: Context, lead: int,
               q_tail: Tensor | None) -> Tensor:
        return sdpa(q, k, v, causal=False, sink=attention.sink)


BIDIRECTIONAL = BidirectionalPass()


class UniformDiffusionRows(nn.Module):
    """One row per token; the readout is the denoiser's distribution over each clean token.

    Time conditioning: a sinusoidal embedding of ``t`` through one learned ``d x d`` map, added
    to every position's token embedding. The alternative, adaLN (a per-layer scale and shift of
    every norm from ``t``), needs a conditioning input at every norm site of the core's blocks;
    the input sum gives every layer ``t`` through the residual stream for ``d^2`` parameters and
    no change to the blocks."""

    def __init__(self, cfg: "ModelConfig"):
        super().__init__()
        self.cfg = cfg
        self.options = cfg.diffusion
        self.width = base_width(cfg)
        self.time_proj = Linear(self.width, self.width)

    # ---- building -------------------------------------------------------------------------------
    def attach_embeddings(self, model: "Transformer") -> None:
        """The time map is this module's own parameter; the model gets no extra table."""

    def attach_block(self, block: "Block", spec: "LayerSpec") -> None:
        """No per-layer parameters."""

    def init_parameters(self, model: "Transformer", init: "Init") -> None:
        init.linear(self.time_proj.weight, role="in")

    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        d = base_width(cfg)
        # The time map runs once per sequence, not per token (under 1/seq_len of a d x d row
        # product per token): like the norms, its FLOPs are not counted; its weights are.
        return Cost(params=d * d)

    @classmethod
    def training_keys(cls, seq_len: int) -> float:
        """Keys a training row attends to: every position of the sequence (bidirectional), not the
        causal triangle's mean ``(seq_len + 1) / 2``."""
        return float(seq_len)

    def cache_batch(self, sequences: int) -> int:
        return sequences

    # ---- the denoiser ---------------------------------------------------------------------------
    def time_embedding(self, t: Tensor) -> Tensor:
        """[B, d] for noise levels ``t`` [B]: cos/sin of ``1000 t`` at geometric frequencies
        (1 down to 1/10000), scaled so that the map's output starts at a token embedding's size."""
        half = self.width // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = 1000.0 * t.float()[:, None] * freqs[None]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
        if features.shape[-1] < self.width:  # an odd width: one zero feature
            features = F.pad(features, (0, self.width - features.shape[-1]))
        return self.time_proj(features.to(self.time_proj.weight.dtype) / math.sqrt(half))

    def denoise(self, model: "Transformer", z: Tensor, t: Tensor, ctx: Context | None = None) -> Tensor:
        """Logits [B, L, V] of the clean tokens given the noisy ones ``z`` [B, L] at levels ``t`` [B]."""
        if ctx is None:
            ctx = Context(rope=model.position.tables(z.shape[1]))
        ctx = dataclasses.replace(ctx, rows=BIDIRECTIONAL)  # shares the run's auxiliary losses (MoE)
        x = model.tok_emb(z)
        x = x + self.time_embedding(t).to(x.dtype)[:, None]
        return model.logits(model.run(x, ctx))

    def objective_nll(self, model: "Transformer", x0: Tensor, ctx: Context,
                      exit_after: int | None = None) -> tuple[Tensor, Tensor]:
        """(the denoiser's logits, the mean over tokens of a one-sample estimate of the negative
        ELBO in nats) for clean sequences ``x0`` [B, L]: one noise level per sequence, one draw of
        the noise. Evaluation draws from a generator seeded by ``diffusion.eval_seed`` and the
        tokens themselves, so measuring the same weights on the same windows repeats exactly."""
        if exit_after is not None:
            raise UsageError(f"early exit reads out a next-token prediction; {NOT_LEFT_TO_RIGHT}")
        gen = None if self.training else self._eval_generator(x0)
        t = sample_times(x0.shape[0], self.options.time_sampling == "stratified", gen, x0.device)
        z = corrupt(x0, alpha(t, self.options.schedule), self.cfg.vocab_size, gen)
        logits = self.denoise(model, z, t, ctx)
        log_p = F.log_softmax(logits.float(), dim=-1)
        return logits, elbo_integrand(log_p, x0, z, t, self.options.schedule).mean()

    def _eval_generator(self, x0: Tensor) -> torch.Generator:
        # A fingerprint of the window's tokens varies the noise from batch to batch (one fixed
        # draw for every batch would make the estimate a fixed quadrature in t, no longer unbiased)
        flat = x0.flatten()[:4096].long()
        fingerprint = int((flat * torch.arange(1, flat.numel() + 1, device=flat.device)).sum())
        gen = torch.Generator(device=x0.device)
        gen.manual_seed((self.options.eval_seed * 1_000_003 + fingerprint) % (1 << 62))
        return gen

    @torch.no_grad()
    def sample(self, model: "Transformer", prompts: list[list[int]], length: int, steps: int,
               temperature: float = 1.0, generator: torch.Generator | None = None) -> Tensor:
        """[B, length] tokens drawn by ``steps`` reverse steps from uniform noise. Row ``b`` keeps
        ``prompts[b]`` fixed at its first positions (clean at every step: the denoiser completes
        the rest around it)."""
        device = model.lm_head.weight.device
        keep = torch.zeros(len(prompts), length, dtype=torch.bool, device=device)
        fixed = torch.zeros(len(prompts), length, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            keep[b, :len(p)] = True
            fixed[b, :len(p)] = torch.tensor(p, dtype=torch.long, device=device)
        z = torch.randint(0, self.cfg.vocab_size, (len(prompts), length), generator=generator, device=device)
        return ancestral_sample(lambda zt, t: self.denoise(model, zt, t), torch.where(keep, fixed, z), steps,
                                self.options.schedule, temperature, generator, keep=keep, fixed=fixed)

    # ---- the left-to-right entry points: none -----------------------------------------------------
    def forward(self, model: "Transformer", idx: Tensor, ctx: Context, followers: bool = True,
                exit_after: int | None = None) -> tuple[Tensor, Tensor | None]:
        raise UsageError(NOT_LEFT_TO_RIGHT)

    def prefill(self, model: "Transformer", idx: Tensor, ctx: Context, lengths: Tensor,
                exit_after: int | None = None) -> Tensor:
        raise UsageError(NOT_LEFT_TO_RIGHT)

    def decode(self, model: "Transformer", idx: Tensor, ctx: Context, exit_after: int | None = None) -> Tensor:
        raise UsageError(NOT_LEFT_TO_RIGHT)

    def log_probs(self, logits: Tensor, extra: Tensor | None) -> Tensor:
        """The denoiser's log-probabilities of the clean tokens."""
        return F.log_softmax(logits.float(), dim=-1)

    def nll(self, logits: Tensor, extra: Tensor | None, targets: Tensor) -> Tensor:
        raise UsageError(NOT_LEFT_TO_RIGHT)
