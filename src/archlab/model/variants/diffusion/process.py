"""The mathematics of uniform-noise discrete diffusion, free of any model: the noise schedule, the
forward process, the continuous-time ELBO's integrand, and one step of the reverse process.

Notation (``docs/architectures.md``, "Uniform diffusion"). ``N`` is the vocabulary size, ``t`` in
[0, 1] the noise level, ``alpha(t)`` the probability that a token is still its clean value by the
schedule (``alpha(0) = 1``, ``alpha(1) = 0``), and

    q_t(z | x) = alpha(t) [z = x] + (1 - alpha(t)) / N

the forward marginal: each token is kept with probability ``alpha`` and otherwise replaced by a
token drawn uniformly from the whole vocabulary (which may draw the clean token again). This is a
continuous-time Markov chain with generator ``beta(t) (11^T / N - I)``, ``beta = -alpha' / alpha``.

The model outputs a distribution ``p`` over each position's clean token, and its reverse process
is the true one's form with ``p`` in place of the clean token (the parametrisation of UDLM,
Schiff et al. 2024): writing ``q_t(y | p) = alpha(t) p(y) + (1 - alpha(t)) / N``,

    reverse rate z -> y   = beta / N  q_t(y | p) / q_t(z | p)                         (y != z)
    p(z_s = y | z_t = z)  = q(z_t = z | z_s = y) q_s(y | p) / q_t(z | p)

For a sequence, the true reverse rate of position ``i`` is exactly this with ``p`` the
distribution of the clean token ``x_i`` given the *other* noisy tokens ``z_{-i}`` (the marginal of
``z`` with ``z_i = y`` over that with ``z_i = z`` is ``q_t(y | p) / q_t(z | p)``), so that is what
the denoiser learns, and an exact one makes the ELBO tight (the tests check it). The alternative,
mixing the true posteriors under ``p`` (D3PM's "x0-parametrisation"), gives rates that grow like
``1 / t`` near ``t = 0`` whenever the model doubts an unchanged token, which makes the
continuous-time ELBO of any imperfect model infinite; this one stays finite.

The true reverse rate given the clean token ``x0`` is the same form with ``p`` the one-hot of
``x0``, and the negative ELBO per token is the integral over ``t`` of the expected KL rate between
the two reverse chains (Campbell et al. 2022; the prior term vanishes since ``q_1`` is uniform):

    -log p(x0) <= int_0^1 E_{z ~ q_t(.|x0)} beta/N sum_{y != z} r(y) (rho(y) - 1 - log rho(y)) dt

with ``r(y) = q_t(y | x0) / q_t(z | x0)`` and ``rho = rate_model / rate_true``. Every summand is
non-negative; it is computed in log space as ``r (expm1(l) - l)``, ``l = log rho``, which keeps the
small differences near ``t = 1`` (where both chains approach the uniform one) from cancelling.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: the schedules ``diffusion.schedule`` may name
SCHEDULES = ("linear", "cosine")

#: sampled noise levels are kept in [T_EDGE, 1 - T_EDGE]: at ``t = 0`` the replaced tokens'
#: probability is 0 and at ``t = 1`` (linear) ``beta`` is infinite, so either end divides by zero.
#: The expected integrand tends to 0 at ``t = 1`` and grows no faster than ``log(1/t)`` near
#: ``t = 0``, so the two slivers left out change the ELBO by the order of 1e-5 nats per token.
T_EDGE = 1e-6


def alpha(t: Tensor, schedule: str) -> Tensor:
    """Probability that a token is still clean at noise level ``t``."""
    if schedule == "linear":
        return 1.0 - t
    if schedule == "cosine":
        return torch.cos(0.5 * math.pi * t)
    raise ValueError(f"unknown diffusion schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def noise(t: Tensor, schedule: str) -> Tensor:
    """``1 - alpha(t)``, computed without the cancellation that ``1 - alpha`` suffers near
    ``t = 0`` in float32 (where cosine's ``alpha`` rounds to 1)."""
    if schedule == "linear":
        return t
    if schedule == "cosine":
        return 2.0 * torch.sin(0.25 * math.pi * t) ** 2
    raise ValueError(f"unknown diffusion schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def beta(t: Tensor, schedule: str) -> Tensor:
    """The forward chain's rate ``-alpha'(t) / alpha(t)``."""
    if schedule == "linear":
        return 1.0 / (1.0 - t)
    if schedule == "cosine":
        return 0.5 * math.pi * torch.tan(0.5 * math.pi * t)
    raise ValueError(f"unknown diffusion schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


def sample_times(batch: int, stratified: bool, generator: torch.Generator | None, device) -> Tensor:
    """One noise level per sequence [batch]. ``stratified``: one uniform offset ``u`` and
    ``t_i = (i + u) / batch`` (each sequence in its own stratum of [0, 1)): still uniform per
    sequence, so the estimate stays unbiased, with far less spread over a batch than independent
    draws. Sequences are shuffled to their strata so the noise level is not tied to a row."""
    if stratified:
        u = torch.rand((), generator=generator, device=device)
        order = torch.randperm(batch, generator=generator, device=device)
        t = (order.to(torch.float32) + u) / batch
    else:
        t = torch.rand(batch, generator=generator, device=device)
    return t.clamp(T_EDGE, 1.0 - T_EDGE)


def corrupt(x0: Tensor, a: Tensor, vocab: int, generator: torch.Generator | None) -> Tensor:
    """A draw of ``z ~ q_t(. | x0)`` for tokens ``x0`` [B, L] with ``a = alpha(t)`` [B]: each token
    independently kept with probability ``a``, else replaced by a uniform draw over the vocabulary."""
    keep = torch.rand(x0.shape, generator=generator, device=x0.device) < a[:, None]
    noise = torch.randint(0, vocab, x0.shape, generator=generator, device=x0.device)
    return torch.where(keep, x0, noise)


def _log_marginal(log_p: Tensor, log_a: Tensor, log_c: Tensor) -> Tensor:
    """``log q_t(y | p) = log(alpha p(y) + (1 - alpha) / N)`` [B, L, N] for ``log_p`` [B, L, N];
    ``log_a = log alpha(t)`` and ``log_c = log((1 - alpha(t)) / N)``, both [B, 1, 1]."""
    return torch.logaddexp(log_a + log_p, log_c)


def elbo_integrand(log_p: Tensor, x0: Tensor, z: Tensor, t: Tensor, schedule: str) -> Tensor:
    """Per token [B, L]: ``beta/N sum_{y != z} r(y) (rho(y) - 1 - log rho(y))`` at noise level ``t``
    [B], the integrand whose mean over ``t ~ U(0, 1)`` and ``z ~ q_t(. | x0)`` is the negative ELBO
    of ``x0`` in nats. ``log_p`` [B, L, N]: the model's log-probabilities of the clean tokens.
    Computed in float32 whatever the inputs."""
    log_p = log_p.float()
    n = log_p.shape[-1]
    t = t.float()
    log_a = torch.log(alpha(t, schedule))[:, None, None]
    log_c = (torch.log(noise(t, schedule)) - math.log(n))[:, None, None]
    at_z = z[..., None]
    log_model = _log_marginal(log_p, log_a, log_c)
    log_model = log_model - log_model.gather(-1, at_z)  # N / beta * the model's rate z -> y
    # the true chain's: the same form with p the one-hot of x0 (log 0 = -inf leaves log c)
    log_true = log_c.expand_as(log_p).scatter(-1, x0[..., None], torch.logaddexp(log_a, log_c).expand(*x0.shape, 1))
    log_true = log_true - log_true.gather(-1, at_z)
    l_ratio = log_model - log_true
    terms = torch.exp(log_true) * (torch.expm1(l_ratio) - l_ratio)
    terms = terms.scatter(-1, at_z, 0.0)  # the sum leaves out y = z (no jump)
    return beta(t, schedule)[:, None] / n * terms.sum(-1)


def reverse_step_probs(probs: Tensor, z: Tensor, a_t: Tensor, a_s: Tensor) -> Tensor:
    """``p(z_s = y | z_t = z)`` [B, L, N] for ``s < t``: the model's clean-token distribution
    ``probs`` [B, L, N] in place of the clean token in the true posterior
    ``q(z_t | z_s = y) q_s(y | x) / q_t(z_t | x)``. ``a_t``, ``a_s``: ``alpha`` at the two
    levels [B]. At ``s = 0`` (``a_s = 1``) it draws the clean token: ``probs`` weighed by how
    likely each token was to become ``z``."""
    n = probs.shape[-1]
    probs = probs.double()
    a_t, a_s = a_t.double()[:, None, None], a_s.double()[:, None, None]
    # q(z_t = z | z_s = y): the chain from s to t keeps a token with probability alpha(t)/alpha(s)
    a_ts = a_t / a_s
    q_step = ((1 - a_ts) / n).expand_as(probs).clone()
    q_step.scatter_add_(-1, z[..., None], a_ts.expand(*z.shape, 1))
    out = q_step * (a_s * probs + (1 - a_s) / n)
    return (out / out.sum(-1, keepdim=True)).float()
