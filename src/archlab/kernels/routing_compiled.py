"""``torch.compile`` version of depth routing: the reference math, arranged so Inductor fuses it.

Eager routing materialises several fp32 copies of the whole ``[N, M, d]`` source stack (the
fp32 cast, the normalised keys, the key-query products, the weighted values); that is what makes
eager AttnRes slow and memory-hungry. Here the RMS scale is applied to the per-head dot product
instead of to the keys (``(s . qg) / rms(s)`` equals ``(s / rms(s)) . qg`` with ``qg =
query * gain``), so no normalised copy of the sources exists even before fusion, and Inductor
turns the rest into a few reductions over the sources. The function is compiled lazily on first
use with ``dynamic=True``: routing sites differ in their number of sources ``N``, and a static
compile would recompile once per site.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from archlab.kernels.routing_reference import validate_route_args

_RouteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                    tuple[torch.Tensor, torch.Tensor]]


def route_fused_math(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing math in compile-friendly form; returns ``(out, weights)``.

    This is the body that ``route_compiled`` compiles. It is plain PyTorch, tested eagerly
    against ``route_reference``, and is also what runs when compilation is unavailable.
    """
    n, m, d = sources.shape
    s = sources.float().unflatten(-1, (heads, d // heads))  # [N, M, H, d/H]
    inv_rms = torch.rsqrt(s.square().sum(dim=(-2, -1)) / d + eps)  # [N, M]
    qg = (query.float() * gain.float()).view(heads, d // heads)
    logits = (s * qg).sum(dim=-1) * inv_rms.unsqueeze(-1)  # [N, M, H]
    weights = torch.softmax(logits, dim=0)
    out = (weights.unsqueeze(-1) * s).sum(dim=0).reshape(m, d).to(sources.dtype)
    return out, weights


_lock = threading.Lock()
_route_fn: _RouteFn | None = None  # compiled on first use; the eager body once compiling failed


def _get_route_fn() -> _RouteFn:
    """Compile ``route_fused_math`` once per process, or fall back to it eagerly."""
    global _route_fn
    with _lock:
        if _route_fn is None:
            if torch._dynamo.is_dynamo_supported():
                _route_fn = torch.compile(route_fused_math, dynamic=True)
            else:
                warnings.warn("torch.compile is not supported here; depth routing runs eagerly",
                              RuntimeWarning, stacklevel=3)
                _route_fn = route_fused_math
        return _route_fn


def route_compiled(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
                   eps: float, return_weights: bool = False,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``route_reference``, computed by the compiled ``route_fused_math``.

    If compiling fails (no C++ compiler for CPU code, an unsupported backend), a warning is
    issued and the same math runs eagerly from then on: a model still trains, only slower.
    Out-of-memory errors are not compile failures and propagate.
    """
    global _route_fn
    validate_route_args(sources, query, gain, heads)
    fn = _get_route_fn()
    try:
        out, weights = fn(sources, query, gain, heads, eps)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - compile errors have no stable common base class
        if fn is route_fused_math:
            raise
        warnings.warn(f"torch.compile failed for depth routing ({type(exc).__name__}); running "
                      "it eagerly from now on", RuntimeWarning, stacklevel=2)
        with _lock:
            _route_fn = route_fused_math
        out, weights = route_fused_math(sources, query, gain, heads, eps)
    if return_weights:
        return out, weights
    return out
