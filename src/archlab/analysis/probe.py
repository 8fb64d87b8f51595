"""Routing diagnostics for attention-residual models (``archlab probe routing``).

Runs a checkpoint on a few batches with the residual module's recorder on (no model copy, no
hooks on other modules) and reports, per row group (primary, decode branch), routing site and
routing head, the weights over depth averaged over positions; per site the mean pairwise
Jensen-Shannon divergence (bits, in [0, 1]) between the heads' depth distributions, both of the
position-averaged distributions (``js_heads``) and averaged over positions of the per-position
distributions (``js_heads_per_position``; heads can disagree token by token yet agree on
average). Writes ``routing.json`` and one heat-map grid PNG per row group (one panel per head:
rows are routing sites, columns source slots, blank where a site has fewer sources).

Tokens come from prepared data (``--data``: its validation batches) or, without data, from a real
text (the standard library's ``argparse.py``) encoded with the checkpoint's ``tokenizer.json``,
or as UTF-8 bytes (modulo the vocabulary) when the checkpoint has no tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from archlab.errors import ArchlabError, CheckpointError, UsageError
from archlab.model.variants.attnres.module import RoutingRecorder, DepthRouting, mean_pairwise_js, site_label

STREAM_NAMES = ("primary", "branch")


def probe_text() -> tuple[str, str]:
    """A real English-and-Python text that every Python install has, and its name."""
    path = Path(argparse.__file__)
    return path.read_text(encoding="utf-8"), f"stdlib {path.name}"


def text_token_batches(ckpt_dir: Path | None, vocab_size: int, n_batches: int, batch_size: int,
                       seq_len: int) -> tuple[list[torch.Tensor], str]:
    """``n_batches`` token batches [batch, seq] from the probe text; the text wraps if short."""
    text, name = probe_text()
    tok_path = ckpt_dir / "tokenizer.json" if ckpt_dir is not None else None
    if tok_path is not None and tok_path.is_file():
        from archlab.data.tokenizer import load_tokenizer

        ids = np.asarray(load_tokenizer(tok_path).encode(text).ids, dtype=np.int64)
        if ids.size and int(ids.max()) >= vocab_size:
            raise CheckpointError(f"{tok_path} produces token id {int(ids.max())} but the model has "
                                  f"vocab_size={vocab_size}")
        source = f"{name}, checkpoint tokenizer"
    else:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) % vocab_size
        source = f"{name}, UTF-8 bytes (no tokenizer in the checkpoint)"
    windows = np.resize(ids, n_batches * batch_size * seq_len).reshape(n_batches, batch_size, seq_len)
    return [torch.from_numpy(w.copy()) for w in windows], source


def routing_module(model: nn.Module) -> DepthRouting:
    res = getattr(model, "residual", None)
    if not isinstance(res, DepthRouting):
        kind = getattr(getattr(model, "cfg", None), "residual", None)
        raise ArchlabError(f"routing probe needs an attnres or delta model; this one has residual kind "
                           f"{getattr(kind, 'kind', '?')!r}")
    return res


def collect_routing(model: nn.Module, batches: list[torch.Tensor], followers: bool = True) -> RoutingRecorder:
    """Run ``model`` on ``batches`` (token ids [B, T]) with routing recording on."""
    res = routing_module(model)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), res.recording() as rec:
            for x in batches:
                model(x.to(device), followers=followers)
    finally:
        model.train(was_training)
    return rec


def _entropy_bits(p: torch.Tensor) -> torch.Tensor:
    return -(torch.xlogy(p, p).sum(0)) / math.log(2.0)


def summarize(model: nn.Module, rec: RoutingRecorder) -> dict[str, Any]:
    """A JSON-ready summary of a recording (see the module docstring for the fields)."""
    res = routing_module(model)
    cfg = model.cfg
    streams: dict[str, Any] = {}
    for stream in sorted({s for s, _ in rec.records}):
        sites = []
        for site in range(res.n_sites + 1):
            r = rec.records.get((stream, site))
            if r is None:
                continue
            w = r.mean_weights  # [N, H] fp64
            heads_mean = w.T.float()  # [H, N]
            top = w.argmax(dim=0).tolist()
            entry = {
                "site": site,
                "label": site_label(site, res.n_visits),
                "n_sources": w.shape[0],
                "sources": r.labels,
                "weights": w.tolist(),  # [N][H]: mean over positions
                "head_sums": w.sum(dim=0).tolist(),
                "entropy_bits": _entropy_bits(w).tolist(),
                "max_entropy_bits": math.log2(w.shape[0]),
                "top_source": [r.labels[i] for i in top],
                "js_heads": float(mean_pairwise_js(heads_mean)),
                "js_heads_per_position": r.js_per_position,
                "positions": r.positions,
            }
            gates = getattr(res, "gates", None)
            if gates is not None:
                entry["gate"] = float(gates[site].detach())
            sites.append(entry)
        name = STREAM_NAMES[stream] if stream < len(STREAM_NAMES) else f"group{stream}"
        streams[name] = {
            "sites": sites,
            "mean_js_heads": float(np.mean([s["js_heads"] for s in sites])) if sites else 0.0,
        }
    return {
        "residual": {"kind": cfg.residual.kind, "heads": res.heads, "blocks": res.n_blocks,
                     "impl": cfg.residual.impl},
        "n_layers": cfg.n_layers,
        "d_model": cfg.d_model,
        "streams": streams,
    }


def routing_table(summary: dict[str, Any], stream: str = "primary"):
    from rich.table import Table

    data = summary["streams"][stream]
    delta = summary["residual"]["kind"] == "delta"
    first = data["sites"][0]["sources"][0] if data["sites"] else "emb"
    table = Table(title=f"depth routing ({stream} rows, {summary['residual']['kind']}, "
                        f"H={summary['residual']['heads']})")
    table.add_column("site")
    table.add_column("sources", justify="right")
    table.add_column(f"w {first}", justify="right")
    table.add_column("w newest", justify="right")
    table.add_column("entropy / max (bits)", justify="right")
    table.add_column("top source per head")
    table.add_column("JS heads", justify="right")
    table.add_column("JS/pos", justify="right")
    if delta:
        table.add_column("gate", justify="right")
    for s in data["sites"]:
        w = np.asarray(s["weights"])
        row = [s["label"], str(s["n_sources"]), f"{w[0].mean():.3f}", f"{w[-1].mean():.3f}",
               f"{np.mean(s['entropy_bits']):.2f} / {s['max_entropy_bits']:.2f}",
               _compress(s["top_source"]), f"{s['js_heads']:.3f}", f"{s['js_heads_per_position']:.3f}"]
        if delta:
            row.append(f"{s['gate']:+.4f}")
        table.add_row(*row)
    return table


def _compress(labels: list[str]) -> str:
    """``a a a b`` -> ``a x3, b``."""
    out: list[str] = []
    i = 0
    while i < len(labels):
        j = i
        while j < len(labels) and labels[j] == labels[i]:
            j += 1
        out.append(labels[i] + (f" x{j - i}" if j - i > 1 else ""))
        i = j
    return ", ".join(out)


def plot_routing(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per row group: a grid of per-head heat maps (sites x source slots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for stream, data in summary["streams"].items():
        sites = data["sites"]
        if not sites:
            continue
        n_heads = len(sites[0]["weights"][0])
        n_cols = max(s["n_sources"] for s in sites)
        grid = np.full((n_heads, len(sites), n_cols), np.nan)
        for r, s in enumerate(sites):
            w = np.asarray(s["weights"])  # [N, H]
            grid[:, r, : w.shape[0]] = w.T
        cols = min(n_heads, 4)
        rows = math.ceil(n_heads / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(0.35 * n_cols * cols + 2, 0.3 * len(sites) * rows + 1.5),
                                 squeeze=False)
        cmap = plt.get_cmap("viridis").with_extremes(bad="#e8e8e8")
        x_labels = max(sites, key=lambda s: s["n_sources"])["sources"]
        im = None
        for h in range(rows * cols):
            ax = axes[h // cols][h % cols]
            if h >= n_heads:
                ax.axis("off")
                continue
            im = ax.imshow(np.ma.masked_invalid(grid[h]), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(f"head {h}", fontsize=8)
            ax.set_yticks(range(len(sites)), [s["label"] for s in sites], fontsize=6)
            ax.set_xticks(range(n_cols), x_labels, rotation=90, fontsize=6)
        if im is not None:
            fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="routing weight (mean over positions)")
        fig.suptitle(f"{summary['residual']['kind']} routing over depth, {stream} rows "
                     f"(mean pairwise JS between heads {data['mean_js_heads']:.3f} bits)", fontsize=10)
        path = out_dir / f"routing_{stream}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def probe_routing(model: nn.Module, batches: list[torch.Tensor], out_dir: str | Path,
                  followers: bool = True, meta: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[Path]]:
    """Record, summarise and write ``routing.json`` plus the heat maps under ``out_dir``."""
    out = Path(out_dir)
    rec = collect_routing(model, batches, followers=followers)
    summary = summarize(model, rec)
    summary.update(meta or {})
    summary["tokens"] = int(sum(x.numel() for x in batches))
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot_routing(summary, out)
    summary["plots"] = [p.name for p in pngs]
    (out / "routing.json").write_text(json.dumps(summary, indent=1))
    return summary, [out / "routing.json", *pngs]


def probe_checkpoint(ckpt: str | Path, data: str | Path | None = None, out: str | Path | None = None,
                     n_batches: int = 4, batch_size: int = 4, seq_len: int | None = None,
                     device: str = "auto") -> tuple[dict[str, Any], list[Path]]:
    """``archlab probe routing``: load a checkpoint, pick tokens, probe, write the outputs.

    ``seq_len`` None is 128, or the model's context when that is shorter; a longer one asked for
    is an error (``UsageError``), not cut to the context."""
    from archlab.io.checkpoint import load_model
    from archlab.io.device import resolve_device

    for key, value in (("batches", n_batches), ("batch-size", batch_size), ("seq-len", seq_len or 1)):
        if value < 1:
            raise ArchlabError(f"--{key} must be positive, got {value}")
    model, run_cfg, ckpt_dir = load_model(ckpt, device=resolve_device(device))
    routing_module(model)
    context = run_cfg.model.max_seq_len
    if seq_len is None:
        seq_len = min(128, context)
    elif seq_len > context:
        raise UsageError(f"--seq-len must be at most the model's context of {context} tokens, got {seq_len}")
    if data is not None:
        from archlab.data.loader import TokenData

        td = TokenData(data)
        td.check_model_vocab(run_cfg.model.vocab_size)
        batches = [x for x, _ in td.val_batches(n_batches, batch_size, seq_len)]
        source = f"validation split of {data}"
    else:
        batches, source = text_token_batches(ckpt_dir, run_cfg.model.vocab_size, n_batches, batch_size, seq_len)
    out_dir = Path(out) if out is not None else ckpt_dir / "probe_routing"
    meta = {"checkpoint": str(ckpt_dir), "tokens_from": source, "seq_len": seq_len}
    return probe_routing(model, batches, out_dir, meta=meta)
