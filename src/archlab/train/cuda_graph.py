"""The whole training step as one CUDA graph (``train.cuda_graph``).

Why: a step made of many small compiled fragments and Python glue keeps the host busy issuing
work, and the GPU waits whenever the host falls behind. AttnRes is the case in point: each of its
``2L + 1`` routing reads is a graph break in the compiled model, so a 124m forward issues 28
compiled fragments and 25 custom autograd calls, and its backward as many again; on an H200 the
host needs about 21 ms to issue a forward whose GPU work takes 28 ms, and the GPU sat idle for
15 ms of a 99 ms step (``docs/benchmarks.md``). A replayed graph issues the step's kernels
with one call, so the step takes as long as its GPU work.

How: the first ``WARMUP_STEPS`` steps run normally, on a side stream as capture requires; they
compile the model, build the Triton kernels and create the optimizer state. The next step is
captured: its batch is copied into static device tensors, the learning rate becomes a device
tensor that each step overwrites, and forward, backward, clipping and AdamW are recorded, then
replayed. Every later step copies its batch in, sets the rate and replays. Nothing the host
decides may change between steps, so a model with host-side control flow that depends on the
data (a ``.item()``, a data-dependent shape) fails to capture; that is reported as one error line.

Random numbers: PyTorch advances the CUDA generator's offset on every replay, so kernels that draw
random numbers get fresh ones each step, as without the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from archlab.errors import ConfigError

WARMUP_STEPS = 3  # ordinary steps before the capture (compilation, kernel builds, optimizer state)

Batch = tuple[torch.Tensor, torch.Tensor]


class GraphedStep:
    """Runs ``body(batches)`` (forward, backward, optimizer update; returns the loss) as a graph.

    ``body`` must take its batches as device tensors and read the learning rate from the
    optimizer's param groups; ``set_lr`` writes the step's rate there (a float before the
    capture, into a device tensor after it).
    """

    def __init__(self, body: Callable[[list[Batch]], torch.Tensor], opt: torch.optim.Optimizer,
                 device: torch.device):
        if device.type != "cuda":
            raise ConfigError(f"train.cuda_graph needs a CUDA device, not {device}")
        self.body, self.opt, self.device = body, opt, device
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[Batch] = []
        self.loss: torch.Tensor | None = None
        self.lr: list[torch.Tensor] = []
        self.side = torch.cuda.Stream(device)

    def set_lr(self, lr: float) -> None:
        if self.lr:
            for t in self.lr:
                t.fill_(lr)
        else:
            for g in self.opt.param_groups:
                g["lr"] = lr

    def __call__(self, batches: list[Batch]) -> torch.Tensor:
        if self.graph is None and self.eager_steps < WARMUP_STEPS:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                loss = self.body(batches)
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self.eager_steps += 1
            return loss
        if self.graph is None:
            self._capture(batches)
        else:
            for (sx, sy), (x, y) in zip(self.static, batches, strict=True):
                sx.copy_(x, non_blocking=True)
                sy.copy_(y, non_blocking=True)
        self.graph.replay()
        # The static loss is overwritten by the next replay; the caller reads it a step later.
        return self.loss.clone()

    def _capture(self, batches: list[Batch]) -> None:
        self.static = [(x.to(self.device, copy=True), y.to(self.device, copy=True)) for x, y in batches]
        for g in self.opt.param_groups:  # a rate the replays can change: a device tensor
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device)
            g["capturable"] = True
            self.lr.append(g["lr"])
        self.opt.zero_grad(set_to_none=True)  # the captured backward allocates the gradients
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.loss = self.body(self.static)
        except RuntimeError as e:  # what CUDA and PyTorch raise for an op that cannot be captured
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"train.cuda_graph: this model's training step cannot be captured as a "
                              f"CUDA graph ({first[:200]}); train without train.cuda_graph") from None
        self.graph = graph
