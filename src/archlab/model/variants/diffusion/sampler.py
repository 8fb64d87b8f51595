"""The ancestral sampler of uniform diffusion: from uniform noise at ``t = 1`` to clean tokens at
``t = 0`` in equal steps of ``t``, each step drawing ``z_s`` from the reverse transition that the
denoiser's clean-token distribution defines (``process.reverse_step_probs``). The last step
(``s = 0``) draws the clean tokens from the denoiser itself."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from archlab.model.variants.diffusion.process import alpha, reverse_step_probs


def clean_token_probs(logits: Tensor, temperature: float) -> Tensor:
    """The denoiser's distribution over clean tokens at ``temperature`` (0: all mass on the most
    likely token)."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def ancestral_sample(denoise: Callable[[Tensor, Tensor], Tensor], z: Tensor, steps: int, schedule: str,
                     temperature: float = 1.0, generator: torch.Generator | None = None,
                     keep: Tensor | None = None, fixed: Tensor | None = None) -> Tensor:
    """Run ``steps`` reverse steps from ``z`` [B, L] at ``t = 1``. ``denoise(z, t)`` gives logits
    [B, L, V] of the clean tokens at noise levels ``t`` [B]. Positions where ``keep`` [B, L] is
    true stay ``fixed`` (a prompt)."""
    if steps < 1:
        raise ValueError(f"the sampler needs at least one step, got {steps}")
    batch = z.shape[0]
    times = torch.linspace(1.0, 0.0, steps + 1, device=z.device, dtype=torch.float64)
    for k in range(steps):
        t, s = times[k].expand(batch), times[k + 1].expand(batch)
        probs = clean_token_probs(denoise(z, t.float()), temperature)
        step = reverse_step_probs(probs, z, alpha(t, schedule), alpha(s, schedule))
        z = torch.multinomial(step.flatten(0, 1), 1, generator=generator).view_as(z)
        if keep is not None:
            z = torch.where(keep, fixed, z)
    return z
