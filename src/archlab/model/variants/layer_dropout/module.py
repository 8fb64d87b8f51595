"""Layer dropout's per-step draw, and a count of the FLOPs a training step executes.

The draw runs on the host, with torch's global CPU generator: the host then knows how many rows
keep each block without waiting for the device (the decoder gathers exactly those rows), and a
checkpoint, which saves that generator's state, resumes the same draws. It is kept out of
``torch.compile``'s graphs: a draw there would be traced once and replayed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from archlab.typed import check


@torch.compiler.disable
def draw_kept(p: float, rows: int, device: torch.device, dropped: list[int] | None = None
              ) -> tuple[Tensor, Tensor] | None:
    """Which of ``rows`` rows run a visit whose drop probability is ``p``: (their indices [k] on
    ``device``, the scale ``1/(1-p)`` of their update as a 0-dim tensor, so that a compiled model
    does not specialise on its value, which changes every step); None when no row can drop it.
    ``dropped``: exactly these rows drop it instead of a draw."""
    check(not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()), "train.cuda_graph",
          "a CUDA graph would replay one layer-dropout draw at every step; set train.cuda_graph=false")
    check(not (torch.distributed.is_available() and torch.distributed.is_initialized()), "train.parallel",
          "layer dropout leaves a block unused on a rank whose rows all drop it, which DDP and FSDP wait for; "
          "train it in one process (train.parallel none)")
    if dropped is None:
        if p <= 0.0:
            return None
        mask = torch.rand(rows) >= p
    else:
        mask = torch.ones(rows, dtype=torch.bool)
        mask[dropped] = False
    kept = mask.nonzero().flatten().to(device, non_blocking=True)
    return kept, torch.full((), 1.0 / (1.0 - p), device=device)


def step_flops(model: nn.Module, idx: Tensor, targets: Tensor) -> int:
    """The FLOPs torch's counter sees in one training forward and backward of ``model`` on
    ``idx``/``targets`` (matmuls and attention, as ``torch.utils.flop_counter`` counts them): a
    block that a row drops adds nothing for that row."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(idx, targets).loss.backward()
    return counter.get_total_flops()
