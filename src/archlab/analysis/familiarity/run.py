"""``archlab probe familiarity``: run a checkpoint over an entity set and score known against
unknown names per domain and layer.

One forward pass per prompt (plain text, no special tokens added). Forward pre-hooks on every
block's ``mlp.w_down`` record its input, the post-SwiGLU activation, so the model is read without
being changed; a layer visited twice (a looped schedule) gives one column per visit. From each
prompt: the mention's last-token IPR and its tokens' spectral entropy per visit (``scores``), the
last-token activation vectors for the linear probe, the mention's token count, and the entropy of
the next-token distribution after the whole prompt (the "first-token entropy" baseline: does the
model already hesitate when asked about the name?).

Each domain (and all domains pooled) is scored on two contrasts, known vs fabricated and known vs
obscure, always with the known names as the positive class.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich import box
from rich.table import Table

from archlab.analysis.familiarity.entities import read_entities
from archlab.analysis.familiarity.linear import cross_validate, select_probe_layer_cv
from archlab.analysis.familiarity.scores import (auroc, auroc_per_column, inverse_participation_ratio,
                                                 permutation_test, select_layer_cv, spectral_entropy,
                                                 stratified_folds)
from archlab.errors import UsageError

CONTRASTS = (("known", "fabricated"), ("known", "obscure"))
SCORES = ("ipr", "entropy")


def mention_span(offsets: list[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the tokens whose character offsets overlap ``[start, end)``."""
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start]


class ActivationRecorder:
    """Forward pre-hooks on each block's ``mlp.w_down``: the input of every call, in call order
    (the visit order), of the first row of the batch (the one prompt)."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list[torch.Tensor] = []
        self.handles = []
        for i, block in enumerate(model.layers):
            down = getattr(getattr(block, "mlp", None), "w_down", None)
            if not isinstance(down, torch.nn.Module):
                kind = type(getattr(block, "mlp", None)).__name__
                raise UsageError(f"probe familiarity reads the SwiGLU MLP's w_down input; layer {i}'s MLP "
                                 f"({kind}) has no w_down")
            self.handles.append(down.register_forward_pre_hook(self._record))

    def _record(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.calls.append(args[0][0].detach().float().cpu())  # [T, H]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def collect(model: torch.nn.Module, tokenizer: Any, items: list[dict[str, str]],
            device: torch.device | str = "cpu") -> dict[str, np.ndarray]:
    """Per item: ``ipr`` and ``entropy`` [n, visits], ``last`` (list over visits of [n, H] last-token
    activations), ``n_tokens`` and ``first_token_entropy`` [n]."""
    model.eval()
    recorder = ActivationRecorder(model)
    ipr, ent, last, n_tokens, first = [], [], [], [], []
    try:
        for item in items:
            enc = tokenizer.encode(item["prompt"], add_special_tokens=False)
            start = item["prompt"].index(item["name"])
            span = mention_span(enc.offsets, start, start + len(item["name"]))
            if len(enc.ids) > model.cfg.max_seq_len:
                raise UsageError(f"prompt {item['prompt']!r} is longer than the model's context")
            recorder.calls.clear()
            # followers=False: a decode-branch model runs its primary rows alone, one pass per visit.
            logits = model(torch.tensor([enc.ids], device=device), followers=False).logits[0, -1].float()
            if len(recorder.calls) != len(model.visits):
                raise UsageError(f"probe familiarity expects one MLP call per layer visit ({len(model.visits)}); "
                                 f"this model made {len(recorder.calls)}")
            logp = torch.log_softmax(logits, -1)
            first.append(float(-(logp.exp() * logp).sum()))
            acts = [a[span] for a in recorder.calls]  # per visit, [tokens of the mention, H]
            ipr.append([float(inverse_participation_ratio(a[-1].numpy())) for a in acts])
            ent.append([spectral_entropy(a.numpy()) for a in acts])
            last.append(np.stack([a[-1].numpy() for a in acts]))
            n_tokens.append(len(span))
    finally:
        recorder.remove()
    stacked = np.stack(last)  # [n, visits, H]
    return {"ipr": np.array(ipr), "entropy": np.array(ent), "last": [stacked[:, v] for v in range(stacked.shape[1])],
            "n_tokens": np.array(n_tokens, dtype=np.float64), "first_token_entropy": np.array(first)}


def analyse_contrast(data: dict[str, Any], labels: np.ndarray, folds_k: int, permutations: int, seed: int,
                     c: float) -> dict[str, Any]:
    """Every number of one contrast on the items ``data`` holds (labels 1 = known)."""
    rng = np.random.default_rng(seed)
    folds = stratified_folds(labels, folds_k, rng)
    out: dict[str, Any] = {"n_known": int(labels.sum()), "n_other": int((1 - labels).sum())}
    for name in SCORES:
        test = permutation_test(data[name], labels, k=folds_k, n_permutations=permutations, seed=seed)
        # The same with names compared only against names of the same token count.
        same_length = permutation_test(data[name], labels, k=folds_k, n_permutations=permutations, seed=seed,
                                       strata=data["n_tokens"])
        out[name] = {"per_layer_auroc": auroc_per_column(data[name], labels).tolist(),
                     "selected_auroc": test.observed.auroc, "selected_layers": test.observed.layers,
                     "selected_signs": test.observed.signs, "permutation_p": test.p_value,
                     "permutation_floor_95": test.floor, "permutations": permutations,
                     "same_length": {
                         "per_layer_auroc": auroc_per_column(data[name], labels, data["n_tokens"]).tolist(),
                         "selected_auroc": same_length.observed.auroc,
                         "selected_layers": same_length.observed.layers,
                         "selected_signs": same_length.observed.signs, "permutation_p": same_length.p_value}}
    for name in ("first_token_entropy", "n_tokens"):
        column = data[name][:, None]
        out[name] = {"auroc": auroc(data[name], labels),
                     "cv_oriented_auroc": select_layer_cv(column, labels, folds).auroc}
    per_layer = [cross_validate(x, labels, folds, c) for x in data["last"]]
    nested = select_probe_layer_cv(data["last"], labels, folds, c, seed=seed)
    out["probe"] = {"per_layer_accuracy": [p.accuracy for p in per_layer],
                    "per_layer_auroc": [p.auroc for p in per_layer],
                    "selected_accuracy": nested.score.accuracy, "selected_auroc": nested.score.auroc,
                    "selected_layers": nested.layers, "C": c}
    return out


def _subset(data: dict[str, Any], idx: np.ndarray) -> dict[str, Any]:
    return {k: ([x[idx] for x in v] if isinstance(v, list) else v[idx]) for k, v in data.items()}


def analyse(items: list[dict[str, str]], data: dict[str, Any], folds_k: int = 5, permutations: int = 1000,
            seed: int = 0, c: float = 0.1) -> dict[str, Any]:
    """Per domain (and ``all``) and contrast, ``analyse_contrast``; contrasts without enough items
    of each kind for the folds are left out."""
    domains = sorted({it["domain"] for it in items})
    kinds = np.array([it["kind"] for it in items])
    where = np.array([it["domain"] for it in items])
    results: dict[str, Any] = {}
    for domain in domains + (["all"] if len(domains) > 1 else []):
        in_domain = np.ones(len(items), bool) if domain == "all" else where == domain
        for pos, neg in CONTRASTS:
            idx = np.flatnonzero(in_domain & np.isin(kinds, (pos, neg)))
            labels = (kinds[idx] == pos).astype(np.int64)
            if min(labels.sum(), (1 - labels).sum()) < folds_k:
                continue
            results[f"{domain}/{pos}-vs-{neg}"] = analyse_contrast(_subset(data, idx), labels, folds_k,
                                                                    permutations, seed, c)
    if not results:
        raise UsageError(f"no domain has at least {folds_k} known and {folds_k} fabricated or obscure names")
    return results


def visit_labels(model: torch.nn.Module) -> list[int]:
    """The layer each recorded column comes from."""
    return [int(layer) for layer in model.visits]


def write_outputs(out: Path, items: list[dict[str, str]], data: dict[str, Any], summary: dict[str, Any]) -> list[Path]:
    """``familiarity.json`` (everything), ``scores.csv`` (per prompt and layer) and ``familiarity.png``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "familiarity.json", out / "scores.csv", out / "familiarity.png"]
    paths[0].write_text(json.dumps(summary, indent=1) + "\n")
    visits = data["ipr"].shape[1]
    with paths[1].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["domain", "kind", "name", "n_tokens", "first_token_entropy"]
                   + [f"ipr_{v}" for v in range(visits)] + [f"entropy_{v}" for v in range(visits)])
        for i, it in enumerate(items):
            w.writerow([it["domain"], it["kind"], it["name"], int(data["n_tokens"][i]),
                        f"{data['first_token_entropy'][i]:.6g}"]
                       + [f"{x:.6g}" for x in data["ipr"][i]] + [f"{x:.6g}" for x in data["entropy"][i]])
    plot(summary, paths[2])
    return paths


def plot(summary: dict[str, Any], path: Path) -> None:
    """One panel per domain and contrast: AUROC per layer of the two scores and the probe, with the
    baselines as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(summary["contrasts"])
    cols = len(CONTRASTS)
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        r = summary["contrasts"][key]
        layers = range(len(r["ipr"]["per_layer_auroc"]))
        ax.plot(layers, r["ipr"]["per_layer_auroc"], "o-", ms=3, label="IPR (last token)")
        ax.plot(layers, r["entropy"]["per_layer_auroc"], "s-", ms=3, label="spectral entropy (mention)")
        ax.plot(layers, r["ipr"]["same_length"]["per_layer_auroc"], color="C0", ls=":", lw=1,
                label="IPR, same token count")
        ax.plot(layers, r["entropy"]["same_length"]["per_layer_auroc"], color="C1", ls=":", lw=1,
                label="entropy, same token count")
        ax.plot(layers, r["probe"]["per_layer_auroc"], "^-", ms=3, label="linear probe (CV)")
        ax.axhline(r["first_token_entropy"]["auroc"], color="k", ls="--", lw=1, label="first-token entropy")
        ax.axhline(r["n_tokens"]["auroc"], color="grey", ls=":", lw=1, label="token count")
        ax.axhline(0.5, color="grey", lw=0.5)
        ax.set_ylim(0, 1)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("layer visit")
        ax.set_ylabel("AUROC (known positive)")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"entity familiarity: {summary['checkpoint']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def familiarity_table(summary: dict[str, Any]) -> Table:
    """One row per domain and contrast: the selection-aware scores (with the layer most folds chose)
    and their permutation p, the nested probe, and the two baselines (AUROC oriented on training
    folds). Fold-by-fold layers and every per-layer value are in the JSON."""
    table = Table(title=f"entity familiarity: {summary['checkpoint']}, {summary['n_items']} prompts",
                  caption="AUROC of known names against the other kind; IPR, spectral entropy S and the "
                          "probe at the layer training folds chose (L: most folds' choice), p: permutation; "
                          "H1: first-token entropy, tokens: the name's token count",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("domain", "vs", "n", "IPR", "p", "S", "p", "probe", "H1", "tokens"):
        table.add_column(col, justify="right")
    for key, r in summary["contrasts"].items():
        domain, contrast = key.split("/")

        def best(name: str) -> str:
            layers = r[name]["selected_layers"]
            return f"{r[name]['selected_auroc']:.3f} L{max(set(layers), key=layers.count)}"

        table.add_row(domain, contrast.split("-vs-")[1][:3] + ".", str(r["n_known"] + r["n_other"]), best("ipr"),
                      f"{r['ipr']['permutation_p']:.3f}", best("entropy"), f"{r['entropy']['permutation_p']:.3f}",
                      best("probe"), f"{r['first_token_entropy']['cv_oriented_auroc']:.3f}",
                      f"{r['n_tokens']['cv_oriented_auroc']:.3f}")
    return table


def same_length_table(summary: dict[str, Any]) -> Table:
    """The two scores' selection-aware AUROC when names are compared only with names of the same
    token count (so length alone cannot separate them), with its within-length permutation p."""
    table = Table(title="the same, comparing only names of equal token count", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("domain", "vs", "IPR", "p", "S", "p"):
        table.add_column(col, justify="right")
    for key, r in summary["contrasts"].items():
        domain, contrast = key.split("/")
        cells = []
        for name in SCORES:
            same = r[name]["same_length"]
            layers = same["selected_layers"]
            cells += [f"{same['selected_auroc']:.3f} L{max(set(layers), key=layers.count)}",
                      f"{same['permutation_p']:.3f}"]
        table.add_row(domain, contrast.split("-vs-")[1][:3] + ".", *cells)
    return table


def probe_familiarity(ckpt: str | Path, entities: str | Path, out: str | Path | None = None, folds: int = 5,
                      permutations: int = 1000, seed: int = 0, c: float = 0.1,
                      device: str = "auto") -> tuple[dict[str, Any], list[Path]]:
    """The whole command: load, collect, analyse, write; (summary, written paths)."""
    from archlab.data.tokenizer import load_tokenizer
    from archlab.errors import CheckpointError
    from archlab.io.checkpoint import load_model
    from archlab.io.device import resolve_device

    items = read_entities(entities)
    dev = resolve_device(device)
    model, cfg, ckpt_dir = load_model(ckpt, dev)
    model = model.float()
    tok_path = ckpt_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} has no tokenizer.json; cannot encode prompts")
    data = collect(model, load_tokenizer(tok_path), items, dev)
    contrasts = analyse(items, data, folds, permutations, seed, c)
    summary = {"checkpoint": str(ckpt_dir), "entities": str(entities), "n_items": len(items),
               "visit_layers": visit_labels(model), "folds": folds, "seed": seed, "contrasts": contrasts}
    target = Path(out) if out is not None else ckpt_dir / "probe_familiarity"
    return summary, write_outputs(target, items, data, summary)
