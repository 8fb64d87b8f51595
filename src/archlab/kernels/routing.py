"""Depth routing dispatcher: one entry point, ``route``, over the three implementations.

``reference`` (eager PyTorch, the ground truth), ``compile`` (the same math through
``torch.compile``) and ``triton`` (fused forward/backward kernels) compute the same function;
the model picks one with ``residual.impl``. ``auto`` takes the fastest that can run where the
tensors live: the Triton kernels on CUDA, the reference elsewhere. On CPU the Triton kernels run
only in Triton's interpreter (``TRITON_INTERPRET=1``), which is for tests and far too slow to
train with, so ``auto`` never picks it there; it must be asked for by name.
"""

from __future__ import annotations

import functools
from typing import Literal, overload

import torch

from archlab.errors import ConfigError
from archlab.kernels import interpreting
from archlab.kernels.routing_compiled import route_compiled
from archlab.kernels.routing_reference import route_reference, validate_tail

IMPLS: tuple[str, ...] = ("auto", "reference", "compile", "triton")


@functools.cache
def _triton_imports() -> bool:
    """Whether the Triton kernels import here (Triton installed and working)."""
    try:
        import archlab.kernels.routing_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_unusable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or ``None`` if they can."""
    if device.type == "cpu" and not interpreting():
        return "on CPU the Triton kernels run only with TRITON_INTERPRET=1 (a test mode)"
    if device.type not in ("cuda", "cpu"):
        return f"the Triton kernels support CUDA (and the CPU interpreter), not {device.type}"
    if not _triton_imports():
        return "triton is not installed (pip install 'archlab[triton]')"
    return None


def available_impls(device: torch.device | str | None = None) -> tuple[str, ...]:
    """The concrete implementations usable for tensors on ``device``.

    ``device`` defaults to CUDA when present, else CPU. ``auto`` is not listed: it always
    resolves to one of these.
    """
    dev = torch.device(device if device is not None
                       else ("cuda" if torch.cuda.is_available() else "cpu"))
    impls = ["reference"]
    if torch._dynamo.is_dynamo_supported():
        impls.append("compile")
    if _triton_unusable_reason(dev) is None:
        impls.append("triton")
    return tuple(impls)


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``impl`` (possibly ``auto``) to the implementation that will run on ``device``.

    Raises ``ConfigError`` for an unknown name or for ``triton`` where it cannot run, so a bad
    ``residual.impl`` fails with one clear line instead of a compiler traceback.
    """
    if impl not in IMPLS:
        raise ConfigError(f"unknown depth-routing impl {impl!r}; choose one of "
                          f"{', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and _triton_imports() else "reference"
    if impl == "triton":
        reason = _triton_unusable_reason(device)
        if reason is not None:
            raise ConfigError(f"depth-routing impl 'triton' is unavailable: {reason}")
    return impl


@overload
def route(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
          eps: float, impl: str = ..., return_weights: Literal[False] = ...,
          tail: torch.Tensor | None = ...) -> torch.Tensor: ...


@overload
def route(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
          eps: float, impl: str = ..., *, return_weights: Literal[True],
          tail: torch.Tensor | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


def route(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
          eps: float, impl: str = "auto", return_weights: bool = False,
          tail: torch.Tensor | None = None,
          ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-head depth routing of ``sources`` [N, M, d] into ``out`` [M, d] (source dtype).

    ``query`` and ``gain`` [d] are the routing site's pseudo-query and RMSNorm gain, ``heads``
    divides ``d`` (1 = AttnRes), ``eps`` is the RMSNorm epsilon. ``sources`` may be the view
    ``buf[:n]`` of a preallocated ``[N_max, M, d]`` buffer (contiguous for a contiguous buffer;
    the Triton path also takes other strides over N and M without copying). With
    ``return_weights`` also returns ``alpha`` [N, M, H] in fp32 for diagnostics; it is
    differentiable for ``reference``/``compile`` and detached for ``triton``.

    ``tail`` [M, d] (sources' dtype) is one more source after the ``N`` of ``sources``: the
    result is that of routing over ``cat(sources, tail[None])``. The Triton kernels read it in
    place, so a source that is read only once (a Block AttnRes partial sum) never has to be
    copied into the buffer; the other implementations concatenate.
    """
    chosen = resolve_impl(impl, sources.device)
    if tail is not None and chosen != "triton":  # the implementation validates the rest
        validate_tail(sources, tail)
        sources = torch.cat([sources, tail.unsqueeze(0)])
    if chosen == "reference":
        return route_reference(sources, query, gain, heads, eps, return_weights)
    if chosen == "compile":
        return route_compiled(sources, query, gain, heads, eps, return_weights)
    from archlab.kernels.routing_triton import route_triton

    return route_triton(sources, query, gain, heads, eps, return_weights, tail)
