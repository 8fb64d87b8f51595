"""``archlab convert`` and ``archlab probe``.

User mistakes raise ``ArchlabError`` subclasses; the main CLI prints them as one line and exits
non-zero. Results go to stdout, as a rich table or summary lines.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from archlab.argtypes import int_at_least, positive_int

CONVERSIONS = ("delta-mhar",)


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the ``convert`` and ``probe`` commands to the main parser."""
    c = subparsers.add_parser(
        "convert", help="convert a checkpoint to another architecture",
        description="Convert a standard-residual checkpoint into a delta multi-head attention-residual "
                    "model that computes exactly the same function until it is trained further.")
    c.add_argument("--to", required=True, choices=CONVERSIONS, help="target architecture")
    c.add_argument("--ckpt", required=True, help="input checkpoint (a run dir, its ckpt dir or a checkpoint dir)")
    c.add_argument("--out", required=True, help="output checkpoint directory")
    c.add_argument("--heads", type=positive_int, default=4, help="routing heads H (must divide d_model; default 4)")
    c.add_argument("--groups", type=int_at_least(0, "0 = one per transformer layer"), default=0,
                   help="delta groups over the 2L sublayers (default 0 = one per transformer layer)")
    c.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    c.set_defaults(func=run_convert)

    p = subparsers.add_parser("probe", help="diagnostics of a trained model",
                              description="Diagnostics that run a checkpoint and report what it does.")
    sub = p.add_subparsers(dest="probe_command", required=True, metavar="{routing,exits}")
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


def run_convert(args: argparse.Namespace) -> int:
    from archlab.convert.delta import convert_checkpoint

    info = convert_checkpoint(args.ckpt, args.out, heads=args.heads, groups=args.groups,
                              overwrite=args.overwrite)
    console = Console()
    console.print(f"converted {info['input']} -> {info['output']} ({args.to}: H={info['heads']}, "
                  f"{info['groups']} groups, {info['new_parameters']:,} new parameters in "
                  f"{info['new_tensors']} tensors)")
    console.print(f"check: max |logit difference| against the original = {info['max_abs_logit_diff']:g}")
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
