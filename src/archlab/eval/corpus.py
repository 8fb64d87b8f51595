"""Loss and bits per byte of a model on the validation split of a prepared data directory.

    from archlab.eval.corpus import evaluate_checkpoint_on
    evaluate_checkpoint_on("data/shakespeare", "runs/tiny")
    # {"loss": 3.91, "bpb": 1.62, "tokens": 32768, "bytes": 121412, "tokens_requested": 32768, ...}

Bits per byte is ``sum(loss in nats over the scored targets) / ln 2 / sum(bytes of those
targets)``: the bytes are those of exactly the tokens scored (``TokenData.target_bytes``), not the
split's average bytes per token, which misstates a prefix of the split by however much that
prefix's tokens differ from the average (a few percent on real corpora). The loss is the mean
over scored target tokens, each counted once: windows never wrap past the end of the split
(``TokenData.val_batches``), and ``tokens`` says how many were scored.

A model whose loss is a bound (``model.objective: uniform-diffusion``: its negative ELBO, one
Monte-Carlo draw of noise level and noise per window) gives an unbiased estimate of an upper bound
on bits per byte, whose draws add to ``se``: the score is flagged ``bound`` and names its bits per
byte ``bpb_bound`` too.

A checkpoint is measured on another corpus only when that corpus was tokenized with the
checkpoint's own tokenizer (``archlab data prepare --tokenizer CKPT``): the same ids with another
vocabulary would be a meaningless number, so a mismatch is one ``DataError`` line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from archlab.errors import DataError, UsageError
from archlab.eval.sample_error import sampling_se


@dataclass(frozen=True)
class CorpusScore:
    """What one evaluation on a validation split measured."""

    loss: float  # mean negative log-likelihood, nats per scored target token
    bpb: float  # bits per UTF-8 byte of the scored targets' text
    tokens: int  # target tokens scored
    bytes: int  # UTF-8 bytes those targets stand for (end-of-text separators count 0)
    tokens_requested: int  # batches * batch_size * seq_len asked for; more than ``tokens`` when
    # the split ended first
    batches: int = 0  # batches scored
    # sampling standard error of ``loss``: the spread of the per-batch losses over the sample
    # (batches are disjoint runs of the split, weighted by their tokens); None below 2 batches
    se: float | None = None
    batch_nats: tuple[float, ...] = ()  # per batch: summed loss (nats) and tokens scored, so that
    batch_tokens: tuple[int, ...] = ()  # two models on the same sample give a paired error
    #: ``loss`` and ``bpb`` are upper bounds (a diffusion model's ELBO), not exact likelihoods;
    #: ``as_dict`` then names the bits per byte ``bpb_bound`` as well
    bound: bool = False

    @property
    def clipped(self) -> bool:
        """The split was shorter than the evaluation asked for (and was not wrapped)."""
        return self.tokens < self.tokens_requested

    def as_dict(self) -> dict[str, Any]:
        """As plain JSON values (the per-batch tuples as lists, as ``--json`` prints them)."""
        out = asdict(self)
        out["batch_nats"], out["batch_tokens"] = list(self.batch_nats), list(self.batch_tokens)
        if self.bound:
            out["bpb_bound"] = self.bpb
        return out


@torch.no_grad()
def score_validation(model: torch.nn.Module, data: Any, n_batches: int, batch_size: int, seq_len: int, *,
                     device: torch.device | str = "cpu",
                     autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
                     ranks: Any = None, exit_after: int | None = None) -> CorpusScore:
    """Loss and bits per byte of ``model`` on the first validation windows of ``data`` (a
    ``TokenData``). The model is left in the train/eval mode it came in. ``exit_after``: the
    model reads out after that many layer visits (early exit; None: all of them).

    ``ranks`` (a ``train.distributed.DistEnv``, under torchrun): each rank scores its own rows of
    every batch and the sums are added over ranks, so every rank returns the one-process score. A
    batch whose rows do not divide among the ranks (the last one of a clipped split) runs whole
    on every rank (FSDP needs every rank in every forward) and is counted by rank 0 alone."""
    was_training = model.training
    model.eval()
    batches = data.val_batches(n_batches, batch_size, seq_len)
    # Per batch: nats, tokens, bytes (summed over ranks once, at the end, as one vector)
    sums = [0.0] * (3 * len(batches))
    bound = False
    try:
        for i, (x, y) in enumerate(batches):
            counted = True
            if ranks is not None:
                if x.shape[0] % ranks.world_size == 0:
                    x, y = ranks.rows(x), ranks.rows(y)
                else:
                    counted = ranks.is_main
            with autocast():
                # exit_after only when asked: any model with the (tokens, targets) call is scored
                out = (model(x.to(device), y.to(device)) if exit_after is None
                       else model(x.to(device), y.to(device), exit_after=exit_after))
            bound = bound or bool(getattr(out, "nll_is_bound", False))
            if counted:
                # nll is the mean over this batch's targets; the last batch may be smaller, so
                # weight by its size to get the mean over all scored tokens.
                sums[3 * i] += float(out.nll) * y.numel()
                sums[3 * i + 1] += y.numel()
                sums[3 * i + 2] += data.target_bytes(y)
    finally:
        model.train(was_training)
    if ranks is not None:
        sums = ranks.sum(sums)
    nats_b, tokens_b = sums[0::3], sums[1::3]
    nats, tokens, n_bytes = sum(nats_b), int(sum(tokens_b)), int(sum(sums[2::3]))
    return CorpusScore(loss=nats / tokens, bpb=nats / math.log(2) / n_bytes, tokens=tokens, bytes=n_bytes,
                       tokens_requested=n_batches * batch_size * seq_len, batches=len(batches),
                       se=sampling_se(nats_b, tokens_b), batch_nats=tuple(nats_b),
                       batch_tokens=tuple(int(t) for t in tokens_b), bound=bound)


def final_sample_batches(train: Any) -> int:
    """How many validation batches of ``train.batch_size`` windows make the run's final
    evaluation sample: ``train.final_eval_tokens`` rounded up to whole batches (the split ends it
    sooner when it is smaller: the whole split up to the cap)."""
    per_batch = train.batch_size * train.seq_len
    return max(1, -(-train.final_eval_tokens // per_batch))


def score_final(model: torch.nn.Module, data: Any, train: Any, *, device: torch.device | str = "cpu",
                autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
                ranks: Any = None, exit_after: int | None = None) -> CorpusScore:
    """The final evaluation of a run (``train`` is its ``TrainConfig``): the first
    ``final_sample_batches(train)`` validation batches at the run's batch size and sequence length,
    the same windows for every run on this data. Training ends with it, and calling it again on
    the saved final weights gives the same numbers (``archlab eval --final``)."""
    return score_validation(model, data, final_sample_batches(train), train.batch_size, train.seq_len,
                            device=device, autocast=autocast, ranks=ranks, exit_after=exit_after)


def clipped_note(score: CorpusScore, data_path: str | Path) -> str:
    """One line saying that the split ended before the requested evaluation did."""
    return (f"the val split of {data_path} holds fewer tokens than the {score.tokens_requested:,} asked "
            f"for; scored {score.tokens:,} (each once, not wrapped)")


def check_same_tokenizer(ckpt: Path, data: Any) -> None:
    """Refuse data tokenized with another tokenizer than the checkpoint's ``tokenizer.json``."""
    from archlab.data.tokenizer import file_sha256

    tok = Path(ckpt) / "tokenizer.json"
    if tok.is_file() and file_sha256(tok) != file_sha256(data.tokenizer_path):
        raise DataError(f"the data in {data.path} was tokenized with another tokenizer than checkpoint "
                        f"{ckpt} was trained with; prepare it with the checkpoint's tokenizer: "
                        f"`archlab data prepare --tokenizer {ckpt} --source ... --out ...`")


def evaluate_checkpoint_on(data_dir: str | Path | None, ckpt: str | Path, *, batches: int = 16,
                           batch_size: int = 8, seq_len: int | None = None,
                           device: torch.device | str = "cpu", final: bool = False,
                           exit_after: int | None = None) -> dict[str, Any]:
    """Loss and bits per byte of checkpoint ``ckpt`` (a run or checkpoint directory) on the
    validation split of ``data_dir`` (None: the data it was trained on).

    Returns ``{"loss", "bpb", "tokens", "bytes", "tokens_requested", "batches", "se", "checkpoint",
    "data"}``. ``seq_len`` defaults to the training sequence length. ``final``: the run's final
    evaluation sample instead (``score_final``: its batch size, sequence length and
    ``final_eval_tokens``, and bf16 autocast on CUDA as in training), so the final loss a run
    recorded is reproduced from its saved weights; ``batches``, ``batch_size`` and ``seq_len``
    are then unused. ``exit_after``: the loss of an early exit after that many layer visits
    (``check_exit``). The data must have been tokenized with the checkpoint's tokenizer; anything
    else is a ``DataError``.
    """
    from archlab.data.loader import TokenData
    from archlab.io.checkpoint import load_model

    model, cfg, ckpt_dir = load_model(ckpt, device)
    check_exit(model, exit_after)
    data = TokenData(data_dir if data_dir is not None else cfg.data.path)
    data.check_model_vocab(cfg.model.vocab_size)
    check_same_tokenizer(ckpt_dir, data)
    if final:
        bf16 = torch.device(device).type == "cuda" and cfg.train.dtype in ("auto", "bfloat16")
        autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else nullcontext
        score = score_final(model, data, cfg.train, device=device, autocast=autocast, exit_after=exit_after)
        return {**score.as_dict(), "checkpoint": str(ckpt_dir), "data": str(data.path), "exit_layer": exit_after}
    seq = seq_len or cfg.train.seq_len
    if seq > cfg.model.max_seq_len:
        raise UsageError(f"--seq-len must be at most the model's context of {cfg.model.max_seq_len} tokens, "
                         f"got {seq}")
    score = score_validation(model, data, batches, batch_size, seq, device=device, exit_after=exit_after)
    return {**score.as_dict(), "checkpoint": str(ckpt_dir), "data": str(data.path), "exit_layer": exit_after}


def check_exit(model: torch.nn.Module, exit_after: int | None) -> None:
    """Refuse an early exit the model cannot take, in one line (``--exit-layer``)."""
    if exit_after is None or exit_after in model.exit_points:
        return
    n = len(model.visits)
    if exit_after > n or exit_after < 1:
        raise UsageError(f"--exit-layer must be from 1 to the {n} layer visits the model runs per token, "
                         f"got {exit_after}")
    raise UsageError(f"--exit-layer {exit_after}: the state there is not as wide as the final norm; "
                     f"exits: {model.exit_points}")
