"""A rich progress bar for training: steps, loss, tokens/s (smoothed) and ETA."""

from __future__ import annotations

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def make_progress(**kwargs) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tok_s]} tok/s"),
        TextColumn("{task.fields[note]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        **kwargs)


class TrainProgress:
    """Adds one task to a shared Progress (the lab's) or owns a Progress of its own."""

    def __init__(self, progress: Progress | None, total_steps: int, start_step: int, tokens_per_step: int,
                 label: str, enabled: bool = True):
        self.own = progress is None and enabled
        self.progress = make_progress(transient=False) if self.own else progress
        self.ema: float | None = None
        self.task = None
        if self.progress is not None:
            if self.own:
                self.progress.start()
            self.task = self.progress.add_task(label, total=total_steps, completed=start_step, loss="-",
                                               tok_s="-", note="")

    def update(self, step: int, loss: float, tok_s: float) -> None:
        # The first steps include compilation and warm-up; a moving average keeps the rate honest.
        self.ema = tok_s if self.ema is None else 0.9 * self.ema + 0.1 * tok_s
        if self.task is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.3f}", tok_s=f"{self.ema:,.0f}")

    def note(self, text: str) -> None:
        if self.task is not None:
            self.progress.update(self.task, note=text)

    def close(self) -> None:
        if self.own and self.progress is not None:
            self.progress.stop()
