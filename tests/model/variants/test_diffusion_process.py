"""Uniform diffusion's mathematics (``model/variants/diffusion/process.py``, ``sampler.py``) against
independent float64 references on one token position, where every expectation over the noisy
token is an exact sum: the forward process at both ends (chi-square), the continuous-time ELBO
against a fine discretisation of the discrete-time ELBO (KLs of explicit posteriors), the bound
tight for an exact denoiser and strictly above for another, and the sampler's output
distribution under a known posterior (chi-square)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from archlab.model.variants.diffusion.process import (
    T_EDGE, alpha, corrupt, elbo_integrand, noise, reverse_step_probs, sample_times)
from archlab.model.variants.diffusion.sampler import ancestral_sample

N = 5  # vocabulary of the one-position references
PI = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)  # an i.i.d. data distribution


def forward_matrix(a: torch.Tensor) -> torch.Tensor:
    """q(z | x) as [..., x, z] for keep probabilities ``a`` [...]: a I + (1 - a) / N."""
    eye = torch.eye(N, dtype=torch.float64)
    return a[..., None, None] * eye + (1 - a[..., None, None]) / N


def fixed_denoiser(pi: torch.Tensor):
    """A denoiser that answers ``pi`` whatever it sees, as log-probabilities [B, L, N]. With one
    position, or tokens drawn i.i.d. from ``pi``, this is the exact one: the clean token's
    distribution given the other positions' noisy tokens is ``pi``."""
    return lambda z, t: pi.log()[None, None].expand(*z.shape, N)


def smooth_denoiser(seed: int):
    """An arbitrary denoiser, smooth in t: log softmax(A[z] + t B[z])."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(N, N, generator=g, dtype=torch.float64), torch.randn(N, N, generator=g, dtype=torch.float64)
    return lambda z, t: torch.log_softmax(a[z[:, 0]] + t.double()[:, None] * b[z[:, 0]], -1)[:, None]


def continuous_elbo(log_p, x0: int, schedule: str, points: int = 20000) -> float:
    """The module's integrand, integrated over t by the midpoint rule and summed exactly over z."""
    t = ((torch.arange(points, dtype=torch.float64) + 0.5) / points).repeat_interleave(N)
    z = torch.arange(N).repeat(points)[:, None]
    a = alpha(t, schedule)
    q_z = torch.where(z[:, 0] == x0, a + (1 - a) / N, (1 - a) / N)
    f = elbo_integrand(log_p(z, t), torch.full_like(z, x0), z, t.float(), schedule)[:, 0].double()
    return float((q_z * f).sum() / points)


def discrete_elbo(log_p, x0: int, schedule: str, steps: int) -> float:
    """The discrete-time ELBO with ``steps`` equal steps: the prior KL at t = 1 plus, per step,
    E_z KL(q(z_s | z_t, x0) || p(z_s | z_t)), p the true posterior with the denoiser's
    distribution in place of the clean token (at s = 0 the first is a point mass on x0)."""
    t = torch.linspace(0, 1, steps + 1, dtype=torch.float64)
    a_t, a_s = alpha(t[1:], schedule), alpha(t[:-1], schedule)  # [K]
    q_t, q_s = forward_matrix(a_t), forward_matrix(a_s)  # [K, x, z]
    q_ts = forward_matrix(a_t / a_s)  # the step's chain from s to t: [K, y, z]
    z = torch.arange(N)
    # the true posterior over y for every step and noisy token: q(z_t | y) q_s(y | x0) / q_t(z_t | x0)
    true = q_ts.transpose(1, 2) * q_s[:, x0][:, None, :] / q_t[:, x0][:, :, None]  # [K, z, y]
    probs = log_p(z.repeat(steps)[:, None], t[1:].repeat_interleave(N)).exp().view(steps, N, N)  # [K, z, x]
    # the model's: q(z_t | y) q_s(y | p) / q_t(z_t | p), with q_s(y | p) = sum_x p(x) q_s(y | x)
    model = q_ts.transpose(1, 2) * torch.einsum("kzx,kxy->kzy", probs, q_s)
    model = model / model.sum(-1, keepdim=True)
    kl = (torch.xlogy(true, true) - torch.xlogy(true, model)).sum(-1)  # [K, z]
    prior = q_t[-1, x0]
    prior_kl = float((torch.xlogy(prior, prior) - prior * math.log(1 / N)).sum())
    return prior_kl + float((q_t[:, x0] * kl).sum())


def test_forward_process_keeps_everything_at_t0_and_is_uniform_at_t1():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randint(0, 10, (200, 100), generator=g)
    assert torch.equal(corrupt(x0, torch.ones(200), 10, g), x0)
    z = corrupt(x0, torch.zeros(200), 10, g)
    assert chisquare(torch.bincount(z.flatten(), minlength=10).numpy()).pvalue > 1e-3
    # in between: kept with probability alpha, and a replacement may draw the clean token again
    a = torch.full((200,), 0.3)
    same = (corrupt(x0, a, 10, g) == x0).double().mean().item()
    want = 0.3 + 0.7 / 10
    assert abs(same - want) < 5 * math.sqrt(want * (1 - want) / x0.numel())
    # a constant input would stay constant without the uniform replacement: it does not
    z = corrupt(torch.zeros_like(x0), torch.zeros(200), 10, g)
    assert chisquare(torch.bincount(z.flatten(), minlength=10).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_schedules_run_from_clean_to_uniform(schedule):
    t = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    a = alpha(t, schedule)
    assert a[0] == 1 and abs(a[-1]) < 1e-12 and bool((a[1:] < a[:-1]).all())
    assert torch.allclose(noise(t, schedule), 1 - a)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_continuous_elbo_is_the_limit_of_the_discrete_time_elbo(schedule):
    log_p = smooth_denoiser(seed=1)
    for x0 in (0, 3):
        cont = continuous_elbo(log_p, x0, schedule)
        fine = discrete_elbo(log_p, x0, schedule, 4000)
        coarse = discrete_elbo(log_p, x0, schedule, 40)
        # the discrete ELBO approaches the continuous one as its steps refine (error ~ 1 / steps)
        assert abs(fine - cont) < 3e-4 and abs(fine - cont) < abs(coarse - cont) / 10, (x0, cont, fine, coarse)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_the_bound_is_tight_for_an_exact_denoiser_and_above_for_another(schedule):
    """With tokens drawn from PI, the exact denoiser makes the model's reverse chain the true one,
    so the ELBO of every token is -log PI(x0) exactly; any other denoiser pays more."""
    exact = fixed_denoiser(PI)
    wrong = fixed_denoiser(torch.full((N,), 1 / N, dtype=torch.float64))
    entropy = float(-(PI * PI.log()).sum())
    bound_exact = bound_wrong = 0.0
    for x0 in range(N):
        e = continuous_elbo(exact, x0, schedule)
        assert abs(e + math.log(PI[x0])) < 1e-4, (x0, e, -math.log(PI[x0]))
        bound_exact += float(PI[x0]) * e
        bound_wrong += float(PI[x0]) * continuous_elbo(wrong, x0, schedule)
    assert abs(bound_exact - entropy) < 1e-4
    assert bound_wrong > entropy + 0.05  # a uniform denoiser's bound is well above the entropy


def test_a_monte_carlo_elbo_stays_above_the_entropy_it_bounds():
    """The training estimator (stratified t, one noise draw) averaged over many sequences of
    i.i.d. tokens, with the exact denoiser, matches the entropy within its error, and with a
    uniform denoiser lies well above it."""
    g = torch.Generator().manual_seed(3)
    x0 = torch.multinomial(PI.float(), 40000 * 4, replacement=True, generator=g).view(40000, 4)
    t = sample_times(x0.shape[0], True, g, "cpu")
    z = corrupt(x0, alpha(t, "linear"), N, g)
    log_p = fixed_denoiser(PI.float())(z, t)
    per_seq = elbo_integrand(log_p, x0, z, t, "linear").double().mean(-1)
    est, se = per_seq.mean().item(), per_seq.std().item() / math.sqrt(per_seq.numel())
    entropy = float(-(PI * PI.log()).sum())
    assert abs(est - entropy) < 4 * se + 1e-3, (est, se, entropy)
    uniform = torch.full((*x0.shape, N), -math.log(N))
    assert elbo_integrand(uniform, x0, z, t, "linear").double().mean().item() > entropy + 0.1


def test_stratified_times_fill_every_stratum_once():
    g = torch.Generator().manual_seed(0)
    t = sample_times(64, True, g, "cpu")
    assert torch.equal(torch.sort((t * 64).floor().long()).values, torch.arange(64))
    t = sample_times(100000, False, g, "cpu")
    assert t.min() >= T_EDGE and t.max() <= 1 - T_EDGE


def test_the_last_reverse_step_weighs_the_denoiser_by_the_noisy_token():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 4, N, generator=g), -1)
    z = torch.randint(0, N, (3, 4), generator=g)
    out = reverse_step_probs(probs, z, torch.full((3,), 0.4), torch.ones(3))
    # p(x0 = y | z) proportional to p(y) q_t(z | y), q_t(z | y) = 0.4 [y = z] + 0.6 / N
    want = probs * (0.6 / N + 0.4 * torch.nn.functional.one_hot(z, N))
    assert torch.allclose(out, want / want.sum(-1, keepdim=True), atol=1e-6)
    # an intermediate step is a distribution that leans toward staying at z
    mid = reverse_step_probs(probs, z, torch.full((3,), 0.2), torch.full((3,), 0.6))
    assert torch.allclose(mid.sum(-1), torch.ones(3, 4), atol=1e-6)


@pytest.mark.parametrize("steps", [1, 7])
@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_sampler_draws_the_data_distribution_from_a_known_posterior(steps, schedule):
    """One position, tokens drawn from PI, the exact denoiser: each reverse step is the true
    reverse transition, so the samples follow PI for any number of steps."""
    g = torch.Generator().manual_seed(steps)
    exact = fixed_denoiser(PI)
    z = torch.randint(0, N, (20000, 1), generator=g)
    out = ancestral_sample(lambda zt, t: exact(zt, t).float(), z, steps, schedule, generator=g)
    counts = torch.bincount(out.flatten(), minlength=N).double()
    assert chisquare(counts.numpy(), (PI * counts.sum()).numpy()).pvalue > 1e-3
    # and not merely any distribution: the uniform start is far from PI
    assert chisquare(torch.bincount(z.flatten(), minlength=N).numpy(), (PI * 20000).numpy()).pvalue < 1e-6


def test_sampler_keeps_fixed_positions_and_temperature_zero_is_the_most_likely_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 3.0, 0.0, 0.0, 0.0])
    z = torch.randint(0, N, (8, 6), generator=g)
    keep = torch.zeros(8, 6, dtype=torch.bool)
    keep[:, :2] = True
    fixed = torch.full((8, 6), 4)
    out = ancestral_sample(lambda zt, t: logits.expand(*zt.shape, N), z, 3, "linear", temperature=0.0,
                           generator=g, keep=keep, fixed=fixed)
    assert bool((out[:, :2] == 4).all()) and bool((out[:, 2:] == 1).all())


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_reverse_step_carries_the_marginal_at_t_to_the_marginal_at_s(schedule):
    """For tokens drawn from PI and the exact denoiser, the reverse transition maps the noisy
    marginal q_t(. | PI) onto q_s(. | PI) exactly, for any s < t (every step of the sampler)."""
    for t, s in ((1.0, 0.6), (0.7, 0.2), (0.3, 0.0)):
        a_t, a_s = alpha(torch.tensor([t]), schedule), alpha(torch.tensor([s]), schedule)
        z = torch.arange(N)[None]  # every noisy token at once: [1, N]
        step = reverse_step_probs(PI.float().expand(1, N, N), z, a_t, a_s)[0].double()  # [z, y]
        marginal_t = a_t.double() * PI + (1 - a_t.double()) / N
        marginal_s = a_s.double() * PI + (1 - a_s.double()) / N
        assert torch.allclose(marginal_t @ step, marginal_s, atol=1e-6), (t, s)
