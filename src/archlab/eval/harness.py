"""Zero-shot scoring: log-likelihoods of continuations, multiple choice and LAMBADA accuracy.

``Scorer`` turns (context, continuation) text pairs into ``Score(logprob, greedy, n_tokens)``:
the summed log-probability of the continuation's tokens given the context, and whether every one
of those tokens is the model's argmax (greedy). Context and continuation are tokenized
separately (``add_special_tokens=False``) after trailing whitespace of the context has been moved
to the front of the continuation, so the scored tokens spell exactly the continuation; an empty
context becomes one ``empty_context_token`` (archlab's ``<|endoftext|>``, id 0). Sequences longer
than the model's ``max_seq_len`` lose context tokens on the left. Requests run in batches of
similar lengths, right-padded (causal attention: padding never reaches a real position).

Metrics (``evaluate_mc``, ``evaluate_lambada``), each accuracy with its binomial standard error
``sqrt(p (1 - p) / n)``:

* multiple choice: ``acc`` picks the choice with the highest summed log-likelihood;
  ``acc_norm`` the highest log-likelihood per **character** of the choice as lm-evaluation-harness
  forms it: the continuation without the one leading space that separates it from the context
  (lm-eval's ``target_delimiter``; ``len(choice)`` over ``doc_to_choice``), so the numbers are
  lm-eval's own. ``acc_per_byte`` is a different metric kept under its own name: log-likelihood
  per UTF-8 byte of the continuation as scored, leading space (and any whitespace moved from the
  context) included - OLMES' ``acc_per_byte``, comparable across tokenizers. The two differ
  where choices hold non-ASCII text (bytes > characters) or differ in length by a little (the
  leading space's +1 weighs more on a short choice), and either can change the pick.
* LAMBADA: ``acc`` counts passages whose last word's tokens (``" " + word``) are all the greedy
  argmax given the passage; ``ppl`` is ``exp(-mean log p(word))``. The two-hop tasks
  (``twohop_id``, ``twohop_ood``) are scored the same way: their ``acc`` is the exact match of
  the answer (``archlab.eval.twohop``).

The scorer works with any archlab model (the readout log-probabilities, so a decode-branch model is
scored by its mixture) or with any callable ``tokens [B, T] -> logits [B, T, V]`` (e.g. a
``transformers`` model: ``Scorer(logits_fn=lambda x: hf(x).logits, tokenizer=tok, max_len=2048)``).
``evaluate(model, tokenizer, tasks, task_dir, limit)`` is the entry point for scripts;
``evaluate_checkpoint(path, tasks)`` evaluates a checkpoint with the tokenizer saved in it (what
``archlab eval --tasks`` and the lab's suites with ``eval.tasks`` call).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from archlab.errors import CheckpointError, DataError
from archlab.eval.tasks import Item, LambadaItem, MCItem, load_tasks


class Score(NamedTuple):
    logprob: float  # sum of log p(continuation token | everything before it)
    greedy: bool  # every continuation token was the argmax
    n_tokens: int  # continuation tokens scored


LogLikelihoodFn = Callable[[Sequence[tuple[str, str]]], list[Score]]


def archlab_logits(model) -> Callable[[Tensor], Tensor]:
    """An archlab model's prediction as [B, T, V] log-probabilities (its readout's)."""

    def forward(idx: Tensor) -> Tensor:
        return model.log_probs(model(idx))

    return forward


def split_whitespace(context: str, continuation: str) -> tuple[str, str]:
    """Move trailing whitespace of ``context`` to the front of ``continuation``."""
    stripped = context.rstrip()
    return stripped, context[len(stripped):] + continuation


class Scorer:
    """Log-likelihood of continuations under a model (callable on a list of text pairs).

    ``model``: an archlab model, or pass ``logits_fn`` (tokens -> logits) with ``max_len``.
    ``tokenizer``: a ``tokenizers.Tokenizer``. ``batch_size``: sequences per forward pass.
    """

    def __init__(self, model=None, tokenizer=None, *, logits_fn: Callable[[Tensor], Tensor] | None = None,
                 max_len: int | None = None, batch_size: int = 8, device: torch.device | str | None = None,
                 empty_context_token: int = 0, progress: Callable[[int], None] | None = None):
        if logits_fn is None:
            if model is None:
                raise ValueError("Scorer needs an archlab model or a logits_fn")
            logits_fn = archlab_logits(model)
            max_len = max_len or model.cfg.max_seq_len
            device = device or next(model.parameters()).device
        if not max_len or max_len < 2:
            raise ValueError("Scorer needs max_len >= 2")
        self.logits_fn = logits_fn
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.batch_size = max(1, batch_size)
        self.device = torch.device(device or "cpu")
        self.empty_context_token = empty_context_token
        self.progress = progress

    # ---- text -> tokens ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        context, continuation = split_whitespace(context, continuation)
        ctx = self.encode(context) or [self.empty_context_token]
        cont = self.encode(continuation)
        if not cont:
            raise DataError(f"a continuation encodes to no tokens: {continuation!r}")
        return ctx, cont

    def __call__(self, requests: Sequence[tuple[str, str]]) -> list[Score]:
        return self.score_tokens([self.encode_pair(c, x) for c, x in requests])

    # ---- tokens -> scores --------------------------------------------------------------------
    @torch.no_grad()
    def score_tokens(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Score]:
        """Scores of (context ids, continuation ids) pairs, in input order."""
        prepared = []
        for ctx, cont in requests:
            seq = list(ctx) + list(cont)
            window = seq[-(self.max_len + 1):]  # left truncation: the context loses its start
            n_cont = min(len(cont), len(window) - 1)
            prepared.append((window[:-1], window[1:], n_cont))
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
        out: list[Score | None] = [None] * len(prepared)
        for start in range(0, len(order), self.batch_size):
            batch = [prepared[i] for i in order[start:start + self.batch_size]]
            width = len(batch[0][0])
            idx = torch.zeros(len(batch), width, dtype=torch.long)
            for r, (inp, _, _) in enumerate(batch):
                idx[r, :len(inp)] = torch.tensor(inp, dtype=torch.long)
            logits = self.logits_fn(idx.to(self.device))
            for r, (inp, tgt, n) in enumerate(batch):
                pos = len(inp)
                rows = logits[r, pos - n:pos].float()
                logp = F.log_softmax(rows, dim=-1)
                target = torch.tensor(tgt[-n:], dtype=torch.long, device=logp.device)
                lp = float(logp.gather(-1, target[:, None]).sum())
                greedy = bool((rows.argmax(-1) == target).all())
                out[order[start + r]] = Score(lp, greedy, n)
            if self.progress is not None:
                self.progress(len(batch))
        return out  # type: ignore[return-value]


# ---- metrics ----------------------------------------------------------------------------------
def stderr(p: float, n: int) -> float:
    """Binomial standard error of an accuracy ``p`` over ``n`` items: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def byte_len(continuation: str, context: str = "") -> int:
    """UTF-8 bytes of the continuation as scored (with the context's trailing whitespace)."""
    return len(split_whitespace(context, continuation)[1].encode("utf-8"))


def choice_len(continuation: str) -> int:
    """Characters of the choice as lm-eval counts them for ``acc_norm``: lm-eval joins context
    and choice with a one-space ``target_delimiter`` and divides by ``len(choice)``, so the space
    that archlab's continuations carry in front is not counted."""
    return len(continuation[1:] if continuation.startswith(" ") else continuation)


def mc_item_record(item: MCItem, scores: Sequence[Score]) -> dict[str, Any]:
    """One multiple-choice item's outcome: per-choice log-likelihoods and the three picks."""
    lls = [s.logprob for s in scores]
    per_char = [lp / max(1, choice_len(cont)) for lp, cont in zip(lls, item.continuations)]
    per_byte = [lp / max(1, byte_len(cont, ctx)) for lp, (ctx, cont) in zip(lls, item.pairs())]
    return {"loglikelihoods": lls, "greedy": [s.greedy for s in scores], "pred": _argmax(lls),
            "pred_norm": _argmax(per_char), "pred_per_byte": _argmax(per_byte), "gold": item.gold}


def evaluate_mc(items: Sequence[MCItem], ll: LogLikelihoodFn,
                records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """acc (raw log-likelihood), acc_norm (per character, lm-eval's), acc_per_byte, their
    standard errors, n; ``records`` (if given) receives ``mc_item_record`` of every item."""
    requests = [p for it in items for p in it.pairs()]
    scores = ll(requests)
    if len(scores) != len(requests):
        raise RuntimeError(f"log-likelihood function returned {len(scores)} scores for {len(requests)} requests")
    hits = {"acc": 0, "acc_norm": 0, "acc_per_byte": 0}
    k = 0
    for it in items:
        rec = mc_item_record(it, scores[k:k + len(it.continuations)])
        k += len(it.continuations)
        hits["acc"] += rec["pred"] == it.gold
        hits["acc_norm"] += rec["pred_norm"] == it.gold
        hits["acc_per_byte"] += rec["pred_per_byte"] == it.gold
        if records is not None:
            records.append(rec)
    n = len(items)
    out: dict[str, Any] = {}
    for metric, count in hits.items():
        out[metric] = count / n
        out[metric + "_stderr"] = stderr(count / n, n)
    out["n"] = n
    return out


def evaluate_lambada(items: Sequence[LambadaItem], ll: LogLikelihoodFn,
                     records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """acc (last word fully greedy), its standard error, ppl of the last word, n; ``records``
    (if given) receives each item's log-likelihood, greedy flag and target."""
    scores = ll([(it.context, " " + it.target) for it in items])
    n = len(items)
    acc = sum(s.greedy for s in scores) / n
    ppl = math.exp(-sum(s.logprob for s in scores) / n)
    if records is not None:
        records.extend({"loglikelihood": s.logprob, "greedy": s.greedy, "n_tokens": s.n_tokens,
                        "target": it.target} for it, s in zip(items, scores))
    return {"acc": acc, "acc_stderr": stderr(acc, n), "ppl": ppl, "n": n}


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def evaluate_items(task: str, items: Sequence[Item], ll: LogLikelihoodFn,
                   records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The metrics of one task's items (all of one kind: ``tasks.load_task`` checks)."""
    if not items:
        raise DataError(f"task {task!r} has no items to evaluate")
    if isinstance(items[0], MCItem):
        return evaluate_mc(items, ll, records)  # type: ignore[arg-type]
    return evaluate_lambada(items, ll, records)  # type: ignore[arg-type]


def n_requests(items: Sequence[Item]) -> int:
    return sum(len(it.continuations) if isinstance(it, MCItem) else 1 for it in items)


def evaluate_tasks(model, tokenizer, loaded: dict[str, Sequence[Item]], *, batch_size: int = 8,
                   device: torch.device | str | None = None,
                   progress: Callable[[int], None] | None = None,
                   records: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, dict[str, Any]]:
    """``evaluate`` on items already loaded (``tasks.load_tasks``); ``progress`` is called with
    the number of requests (continuations) scored after each batch (``n_requests`` in all);
    ``records`` (if given) receives each task's per-item records (``evaluate_mc``/``_lambada``)."""
    model.eval()
    scorer = Scorer(model, tokenizer, batch_size=batch_size, device=device, progress=progress)
    out = {}
    with torch.no_grad():
        for name, items in loaded.items():
            per_item = records.setdefault(name, []) if records is not None else None
            out[name] = evaluate_items(name, items, scorer, per_item)
    return out


def load_checkpoint_for_eval(path, device: torch.device | str = "cpu"):
    """(model in eval mode, run config, checkpoint dir, tokenizer) of any checkpoint (a run
    directory means its latest); the tokenizer is the ``tokenizer.json`` the trainer copies from
    the run's data into every checkpoint (verified against its checksum when loading)."""
    from archlab.data.tokenizer import load_tokenizer
    from archlab.io.checkpoint import load_model

    model, cfg, ckpt = load_model(path, device)
    tok_path = ckpt / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no tokenizer.json; cannot encode task text")
    return model.eval(), cfg, ckpt, load_tokenizer(tok_path)


def evaluate_checkpoint(path, loaded: dict[str, Sequence[Item]], *, device: torch.device | str = "cpu",
                        batch_size: int = 8, progress: Callable[[int], None] | None = None,
                        records: dict[str, list[dict[str, Any]]] | None = None):
    """(``{task: metrics}``, checkpoint dir) of a checkpoint on loaded task items; two-hop items
    must be the queries held out of the checkpoint's own training data (``eval.twohop``)."""
    from archlab.eval.twohop import check_items_match_data

    model, cfg, ckpt, tok = load_checkpoint_for_eval(path, device)
    check_items_match_data(cfg.data.path, loaded)
    return evaluate_tasks(model, tok, loaded, batch_size=batch_size, device=device, progress=progress,
                          records=records), ckpt


def evaluate(model, tokenizer, tasks: str | list[str], task_dir=None, limit: int | None = None,
             batch_size: int = 8, show_progress: bool = False) -> dict[str, dict[str, Any]]:
    """``{task: {acc, acc_stderr, n, [acc_norm, acc_per_byte and their stderr | ppl]}}`` of an archlab model.

    ``tasks``: comma-separated names (or ``name=PATH``) or a list; ``task_dir``: where to find
    them (``tasks.find_task``); ``limit``: the first N items of each task.
    """
    from archlab.eval.progress import task_progress

    loaded = load_tasks(tasks, task_dir, limit)
    with task_progress(loaded, enabled=show_progress) as progress:
        return evaluate_tasks(model, tokenizer, loaded, batch_size=batch_size, progress=progress)


def results_table(results: dict[str, dict[str, Any]], title: str = "zero-shot accuracy"):
    """A rich table: task, split (when the results name it), n, acc +- stderr, acc_norm +- stderr,
    acc_per_byte, LAMBADA ppl."""
    from rich.table import Table

    table = Table(title=title)
    with_split = any("split" in r for r in results.values())
    for col in ("task", "split", "n", "acc", "acc_norm", "acc_per_byte", "ppl"):
        if col != "split" or with_split:
            table.add_column(col, justify="left" if col in ("task", "split") else "right")
    for name, r in results.items():
        acc = f"{r['acc']:.4f} ± {r['acc_stderr']:.4f}"
        norm = f"{r['acc_norm']:.4f} ± {r['acc_norm_stderr']:.4f}" if "acc_norm" in r else "-"
        per_byte = f"{r['acc_per_byte']:.4f}" if "acc_per_byte" in r else "-"
        ppl = f"{r['ppl']:.2f}" if "ppl" in r else "-"
        split = [r.get("split", "-")] if with_split else []
        table.add_row(name, *split, f"{r['n']:,}", acc, norm, per_byte, ppl)
    return table
