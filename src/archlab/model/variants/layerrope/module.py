"""LayerRoPE: one shared gain, rotated and scaled with depth, at every norm site.

The kind's module (the model's ``norms``) holds the only gain vector ``g`` ([d_model], fp32,
ones at init). For layer ``l`` (0-based) let ``u = log(l + 1)``; the rotated gain is

    G_l[2j] + i G_l[2j+1] = (g_2j + i g_2j+1) * exp(r + i theta_j),
    r = a + b u,    theta_j = exp(a_rot + b_rot u) * base^(-2j/d)          (d = d_model)

(interleaved pairs; defaults a = 0, b = -0.5, a_rot = 0, b_rot = -0.5, base = 100, so at init
``|G_l| = |g| / sqrt(l + 1)``). It is computed in (at least) fp32 on every call; ``g`` stays fp32 when the
model is cast to a 16-bit dtype, and under autocast nothing here runs in 16 bits.

Sites (``RMSNormSites`` names them):

* ``attn_in``, ``mlp_in``: RMSNorm without a gain of its own (fp32, ``eps = model.norm_eps``),
  times ``G_l``.
* ``attn_out``, ``mlp_out`` (``layerrope.out_sites``, default on): the sublayer output times
  ``G_l``, **not normalised** (a gain, like the input sites', without a second norm).
* ``final``: ``layerrope.final = rmsnorm`` (default) is the baseline's RMSNorm with its own gain
  (the spec replaces the *per-layer* gains); ``rotated`` uses ``G_L`` (``l = n_layers``).

The scalars are fixed by default (``layerrope.learnable = false``), so the four sites of a layer
share ``G_l``; learnable, each site kind has its own ``(a, b, a_rot, b_rot)`` (``per_site``), 1-D
parameters initialised to the configured values. A site narrower than ``d_model`` (a per-layer
width) uses the first ``width`` entries of ``G_l``.

Site modules keep a reference to the owner in a tuple, so ``g`` is registered once, as
``norms.g``. The accounting has no part for a norm kind's shared parameters, so ``cost`` states
them under the ``final`` site.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from archlab.model.core.cost import Cost
from archlab.model.core.layers import RMSNorm
from archlab.model.core.spec import base_width

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec

SITE_SETS = ("attn_in", "attn_out", "mlp_in", "mlp_out", "final")
_SCALARS = ("a", "b", "a_rot", "b_rot")


def _wide(t: Tensor) -> Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class LayerRopeNorms(nn.Module):
    """The ``norm`` slot's ``layerrope`` kind: owns ``g`` (and the scalars when learnable)."""

    def __init__(self, cfg: "ModelConfig"):
        super().__init__()
        o = cfg.layerrope
        self.opts = o
        self.d = base_width(cfg)  # the widest site (d_model unless a width kind widens the embedding)
        self.n_layers = cfg.n_layers
        self.eps = cfg.norm_eps
        self.g = nn.Parameter(torch.ones(self.d, dtype=torch.float32))
        self.learnable = o.learnable
        self.n_sets = len(SITE_SETS) if o.per_site else 1
        if o.learnable:
            for name in _SCALARS:
                setattr(self, name, nn.Parameter(torch.full((self.n_sets,), getattr(o, name), dtype=torch.float32)))

    def init_parameters(self, init: "Init") -> None:
        with torch.no_grad():
            self.g.fill_(1.0)
            if self.learnable:
                for name in _SCALARS:
                    getattr(self, name).fill_(getattr(self.opts, name))

    def _apply(self, fn, recurse=True):
        # Gains stay in (at least) fp32 when the model is cast to bf16/fp16.
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.is_floating_point() and p.dtype not in (torch.float32, torch.float64):
                p.data = p.data.float()
        return self

    # ---- the rotated gain ---------------------------------------------------------------------
    def scalars(self, site: str):
        """(a, b, a_rot, b_rot) of ``site``: floats when fixed, 0-dim parameters when learnable."""
        if not self.learnable:
            return tuple(getattr(self.opts, n) for n in _SCALARS)
        k = SITE_SETS.index(site) if self.n_sets > 1 else 0
        return tuple(getattr(self, n)[k] for n in _SCALARS)

    def gain(self, layer: int, site: str, width: int | None = None) -> Tensor:
        """``G_layer`` for ``site`` ([width], the dtype of ``g``: fp32 or wider)."""
        g = _wide(self.g)
        a, b, a_rot, b_rot = self.scalars(site)
        u = math.log(layer + 1)
        half = self.d // 2
        freqs = self.opts.base ** (-2 * torch.arange(half, device=g.device, dtype=torch.float64) / self.d)
        with torch.autocast(device_type=g.device.type, enabled=False):
            scale = torch.exp(torch.as_tensor(a + b * u, dtype=g.dtype, device=g.device))
            speed = torch.exp(torch.as_tensor(a_rot + b_rot * u, dtype=g.dtype, device=g.device))
            theta = speed * freqs.to(g.dtype)
            cos, sin = torch.cos(theta), torch.sin(theta)
            gr, gi = g[0::2], g[1::2]
            out = torch.stack((gr * cos - gi * sin, gr * sin + gi * cos), dim=-1).flatten() * scale
        return out if width is None or width == self.d else out[:width]

    # ---- sites --------------------------------------------------------------------------------
    def site(self, spec: "LayerSpec | None", name: str, width: int) -> nn.Module | None:
        o = self.opts
        if name in ("attn_out", "mlp_out"):
            return RotatedGain(self, spec.layer, name, width, normalise=False) if o.out_sites else None
        if name == "final":
            if o.final == "rmsnorm":
                return RMSNorm(width, self.eps)
            return RotatedGain(self, self.n_layers, name, width, normalise=True)
        return RotatedGain(self, spec.layer, name, width, normalise=True)

    @classmethod
    def cost(cls, cfg: "ModelConfig", name: str, width: int) -> Cost:
        """Per-layer sites own nothing; the shared ``g`` (and learnable scalars) are stated under
        ``final`` together with the final norm's own gain."""
        if name != "final":
            return Cost()
        o = cfg.layerrope
        shared = base_width(cfg) + (len(_SCALARS) * (len(SITE_SETS) if o.per_site else 1) if o.learnable else 0)
        return Cost(params=shared + (width if o.final == "rmsnorm" else 0))


class RotatedGain(nn.Module):
    """One site: (RMSNorm without gain, when ``normalise``) times the owner's ``G_layer``."""

    def __init__(self, owner: LayerRopeNorms, layer: int, site: str, width: int, normalise: bool):
        super().__init__()
        self._owner = (owner,)  # a tuple: the shared gain is registered once, in model.norms
        self.layer, self.site_name, self.width, self.normalise = layer, site, width, normalise
        self.eps = owner.eps

    @property
    def owner(self) -> LayerRopeNorms:
        return self._owner[0]

    def init_parameters(self, init: "Init") -> None:
        pass  # owns no parameters

    def forward(self, x: Tensor) -> Tensor:
        gain = self.owner.gain(self.layer, self.site_name, self.width)
        xf = _wide(x)
        if self.normalise:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * gain.to(xf.dtype)).type_as(x)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, site={self.site_name}, width={self.width}, normalise={self.normalise}"
