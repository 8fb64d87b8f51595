"""``archlab convert`` and ``archlab probe``.

User mistakes raise ``ArchlabError`` subclasses; the main CLI prints them as one line and exits
non-zero. Results go to stdout, as a rich table or summary lines.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from archlab.argtypes import float_in, int_at_least, non_negative_int, positive_int
from archlab.errors import UsageError

CONVERSIONS = ("delta-mhar", "hidden")


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the ``convert`` and ``probe`` commands to the main parser."""
    c = subparsers.add_parser(
        "convert", help="convert a checkpoint to another architecture",
        description="Convert a checkpoint: --to delta-mhar, a standard-residual model into a delta multi-head "
                    "attention-residual model that computes exactly the same function until it is trained "
                    "further; --to hidden, a one-row model into a Hidden Decoding model of --streams streams "
                    "whose hidden streams' embedding tables start as copies of the token embedding (the "
                    "same function, with its one default mixing layer).")
    c.add_argument("--to", required=True, choices=CONVERSIONS, help="target architecture")
    c.add_argument("--ckpt", required=True, help="input checkpoint (a run dir, its ckpt dir or a checkpoint dir)")
    c.add_argument("--out", required=True, help="output checkpoint directory")
    c.add_argument("--heads", type=positive_int, default=4, help="routing heads H (must divide d_model; default 4)")
    c.add_argument("--groups", type=int_at_least(0, "0 = one per transformer layer"), default=0,
                   help="delta groups over the 2L sublayers (default 0 = one per transformer layer)")
    c.add_argument("--streams", type=int_at_least(2), default=None,
                   help="--to hidden: streams per token, the last one scored (default 2)")
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c.set_defaults(func=run_convert)

    p = subparsers.add_parser("probe", help="diagnostics of a trained model",
                              description="Diagnostics that run a checkpoint and report what it does.")
    sub = p.add_subparsers(dest="probe_command", required=True, metavar="{routing,exits,entities,familiarity}")
    r = sub.add_parser(
        "routing", help="depth-routing weights of an attnres/delta model",
        description="Per routing site and head: the weights over depth (mean over positions) and the "
                    "mean pairwise Jensen-Shannon divergence between heads; writes routing.json and "
                    "heat maps.")
    r.add_argument("--ckpt", required=True, help="checkpoint (a run dir, its ckpt dir or a checkpoint dir)")
    r.add_argument("--data", default=None,
                   help="prepared data directory (its validation split); default: a stdlib text "
                        "encoded with the checkpoint's tokenizer")
    r.add_argument("--out", default=None, help="output directory (default: CKPT/probe_routing)")
    r.add_argument("--batches", type=positive_int, default=4, help="batches to run (default 4)")
    r.add_argument("--batch-size", type=positive_int, default=4, help="sequences per batch (default 4)")
    r.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence, at most the model's context (default 128, or the "
                        "context when it is shorter)")
    r.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    r.set_defaults(func=run_probe_routing)

    x = sub.add_parser(
        "exits", help="validation loss at every early exit, in one pass",
        description="Per layer visit L, the validation loss when the model reads out after its first L "
                    "visits through the shared final norm and head (`archlab eval --exit-layer L` for each L, "
                    "in one pass over the windows `archlab eval` scores). A decode-branch model is read out "
                    "by its primary rows.")
    x.add_argument("--ckpt", required=True, help="checkpoint (a run dir, its ckpt dir or a checkpoint dir)")
    x.add_argument("--data", default=None, help="prepared data directory whose validation split is scored "
                   "(default: the one the model was trained on)")
    x.add_argument("--batches", type=positive_int, default=16, help="validation batches (default 16, as eval)")
    x.add_argument("--batch-size", type=positive_int, default=8, help="rows per batch (default 8, as eval)")
    x.add_argument("--seq-len", type=int_at_least(0, "0 = the training sequence length"), default=0,
                   help="tokens per row, at most the model's context (default: the training sequence length)")
    x.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    x.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    x.set_defaults(func=run_probe_exits)
    register_familiarity(sub)


def register_familiarity(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``probe entities`` (build the entity set) and ``probe familiarity`` (score a checkpoint on it)."""
    e = sub.add_parser(
        "entities", help="write an entity set: known, obscure and fabricated names in questions",
        description="Known and obscure-but-real names from data installed packages ship (the cities of the "
                    "tz database's zone.tab, from tzdata, pytz or the system; Python's stdlib modules ranked "
                    "by how often the stdlib imports them) and fabricated names from a character trigram "
                    "model of the real ones, each in a one-sentence question; balanced per domain, fixed by "
                    "--seed (for given Python and tz database versions). See docs/analysis.md.")
    e.add_argument("--out", required=True, help="JSON file to write")
    e.add_argument("--seed", type=non_negative_int, default=0, help="seed of the sampling (default 0)")
    e.add_argument("--per-kind", type=positive_int, default=40,
                   help="names of each kind (known, obscure, fabricated) per domain (default 40)")
    e.set_defaults(func=run_probe_entities)

    f = sub.add_parser(
        "familiarity", help="known vs unknown entities from the MLP activations' dispersion",
        description="One forward pass per prompt of --entities; per layer, the inverse participation ratio "
                    "(mention's last token) and spectral entropy (mention's tokens) of the post-SwiGLU "
                    "activations, their AUROC known vs fabricated and known vs obscure per domain, the best "
                    "layer chosen on training folds with a permutation p, a cross-validated logistic probe, "
                    "and the first-token-entropy and token-count baselines. Writes familiarity.json, "
                    "scores.csv and familiarity.png.")
    f.add_argument("--ckpt", required=True, help="checkpoint (a run dir, its ckpt dir or a checkpoint dir)")
    f.add_argument("--entities", required=True, help="entity file from `archlab probe entities`")
    f.add_argument("--out", default=None, help="output directory (default: CKPT/probe_familiarity)")
    f.add_argument("--folds", type=int_at_least(2), default=5, help="cross-validation folds (default 5)")
    f.add_argument("--permutations", type=positive_int, default=1000,
                   help="shuffled label sets for the permutation p (default 1000)")
    f.add_argument("--seed", type=non_negative_int, default=0, help="seed of folds and permutations (default 0)")
    f.add_argument("--C", dest="c", type=float_in(0, low_open=True), default=0.1,
                   help="inverse L2 strength of the logistic probe, on standardised features (default 0.1)")
    f.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    f.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    f.set_defaults(func=run_probe_familiarity)


def run_convert(args: argparse.Namespace) -> int:
    if args.to == "hidden":
        return _convert_to_hidden(args)
    if args.streams is not None:
        raise UsageError("--streams applies to --to hidden only")
    from archlab.convert.delta import convert_checkpoint

    info = convert_checkpoint(args.ckpt, args.out, heads=args.heads, groups=args.groups,
                              overwrite=args.overwrite)
    console = Console()
    console.print(f"converted {info['input']} -> {info['output']} ({args.to}: H={info['heads']}, "
                  f"{info['groups']} groups, {info['new_parameters']:,} new parameters in "
                  f"{info['new_tensors']} tensors)")
    console.print(f"check: max |logit difference| against the original = {info['max_abs_logit_diff']:g}")
    return 0


def _convert_to_hidden(args: argparse.Namespace) -> int:
    from archlab.convert.hidden import convert_checkpoint

    info = convert_checkpoint(args.ckpt, args.out, streams=args.streams or 2, overwrite=args.overwrite)
    console = Console()
    console.print(f"converted {info['input']} -> {info['output']} (hidden: {info['streams']} streams, mixing "
                  f"layers {info['mix_layers']}, {info['new_parameters']:,} new parameters)")
    console.print(f"check: max |log-probability difference| against the original = "
                  f"{info['max_abs_logprob_diff']:g}")
    return 0


def run_probe_exits(args: argparse.Namespace) -> int:
    from archlab.analysis.exits import exits_table, probe_exits

    result = probe_exits(args.ckpt, data=args.data, n_batches=args.batches, batch_size=args.batch_size,
                         seq_len=args.seq_len or None, device=args.device)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        Console().print(exits_table(result))
    return 0


def run_probe_routing(args: argparse.Namespace) -> int:
    from archlab.analysis.probe import probe_checkpoint, routing_table

    summary, paths = probe_checkpoint(args.ckpt, data=args.data, out=args.out, n_batches=args.batches,
                                      batch_size=args.batch_size, seq_len=args.seq_len, device=args.device)
    console = Console()
    for stream in summary["streams"]:
        console.print(routing_table(summary, stream))
    console.print(f"tokens: {summary['tokens']:,} from {summary['tokens_from']}")
    for p in paths:
        console.print(f"wrote {p}")
    return 0


def run_probe_entities(args: argparse.Namespace) -> int:
    from archlab.analysis.familiarity.entities import write_entities

    data = write_entities(args.out, seed=args.seed, per_kind=args.per_kind)
    domains = sorted({it["domain"] for it in data["items"]})
    print(f"wrote {args.out}: {len(data['items'])} prompts, {args.per_kind} known, obscure and fabricated names "
          f"per domain ({', '.join(domains)}), seed {args.seed}")
    return 0


def run_probe_familiarity(args: argparse.Namespace) -> int:
    from archlab.analysis.familiarity.run import familiarity_table, probe_familiarity, same_length_table

    summary, paths = probe_familiarity(args.ckpt, args.entities, out=args.out, folds=args.folds,
                                       permutations=args.permutations, seed=args.seed, c=args.c,
                                       device=args.device)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    console = Console()
    console.print(familiarity_table(summary))
    console.print(same_length_table(summary))
    for p in paths:
        console.print(f"wrote {p}")
    return 0
