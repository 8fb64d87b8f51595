"""What depth routing records when asked (``DepthRouting.recording``): per (row group, site), the
routing weights summed over positions and the mean pairwise Jensen-Shannon divergence between
heads, optionally the sources themselves; ``archlab probe routing`` reads it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def _js_bits(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon divergence (bits, in [0, 1]) between distributions over the last axis."""
    m = 0.5 * (p + q)
    kl_p = torch.xlogy(p, p).sum(-1) - torch.xlogy(p, m).sum(-1)
    kl_q = torch.xlogy(q, q).sum(-1) - torch.xlogy(q, m).sum(-1)
    return (0.5 * (kl_p + kl_q) / math.log(2.0)).clamp_min(0.0)


def mean_pairwise_js(dists: Tensor) -> Tensor:
    """Mean JS divergence (bits) over head pairs; ``dists`` [..., H, N] -> [...] (0 for H = 1)."""
    h = dists.shape[-2]
    if h < 2:
        return dists.new_zeros(dists.shape[:-2])
    total = dists.new_zeros(dists.shape[:-2])
    for a in range(h):
        for b in range(a + 1, h):
            total = total + _js_bits(dists[..., a, :], dists[..., b, :])
    return total / (h * (h - 1) / 2)


@dataclass
class SiteRecord:
    """Routing statistics of one (row group, site), accumulated over recorded forwards."""

    labels: list[str]
    weight_sum: Tensor  # [N, H] fp64: sum over positions of alpha
    positions: int = 0
    js_sum: float = 0.0  # sum over positions of the mean pairwise JS between heads (bits)
    #: with ``sources=True``: (sources [N, M, d], read [M, d], weights [N, M, H] fp32) per forward
    captured: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)

    @property
    def mean_weights(self) -> Tensor:
        """[N, H] routing weights averaged over positions."""
        return self.weight_sum / max(self.positions, 1)

    @property
    def js_per_position(self) -> float:
        return self.js_sum / max(self.positions, 1)


class RoutingRecorder:
    """Collects routing weights (and optionally sources) during forwards; see ``recording``."""

    def __init__(self, sources: bool = False) -> None:
        self.sources = sources
        self.records: dict[tuple[int, int], SiteRecord] = {}

    def add(self, stream: int, site: int, labels: list[str], weights: Tensor,
            sources: Tensor | None, read: Tensor | None) -> None:
        w = weights.detach().float()  # [N, M, H]
        rec = self.records.get((stream, site))
        if rec is None:
            rec = SiteRecord(labels=labels, weight_sum=torch.zeros(w.shape[0], w.shape[2], dtype=torch.float64))
            self.records[(stream, site)] = rec
        rec.weight_sum += w.sum(dim=1).double().cpu()
        rec.positions += w.shape[1]
        rec.js_sum += float(mean_pairwise_js(w.permute(1, 2, 0)).sum())
        if self.sources and sources is not None and read is not None:
            rec.captured.append((sources.detach().clone(), read.detach().clone(), w.clone()))
