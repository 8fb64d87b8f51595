"""The trainer: one obvious path from prepared data to a trained, checkpointed model.

The whole training step is ``train_step`` and ``_update``; everything else is bookkeeping
(schedule, evaluation, checkpoints, logs). Determinism: the batch at step k depends only on
(data seed, k), the weights only on the init seed, and a checkpoint stores optimizer moments and
RNG states, so a resumed run continues exactly as if it had never stopped (bitwise on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from archlab.config import RunConfig, TrainConfig, dump_yaml
from archlab.errors import ArchlabError, CheckpointError, TrainingDiverged
from archlab.model import build_model
from archlab.model.accounting import mfu_flops_per_token, param_counts
from archlab.io import checkpoint as ckpt_io
from archlab.io import dcp as dcp_io
from archlab.io import run_dir
from archlab.train import distributed
from archlab.train.cuda_graph import GraphedStep
from archlab.io.device import device_name, peak_flops, resolve_device
from archlab.train.progress import TrainProgress


@dataclass
class TrainResult:
    final_val_loss: float  # the final weights on the final sample (``score_final``); a run stopped
    final_val_bpb: float  # short: its last evaluation on the curve's sample
    val_curve: list[dict[str, Any]] = field(default_factory=list)
    train_curve: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    device: str = ""
    mfu: float | None = None
    params: int = 0
    final_val_tokens: int | None = None  # tokens of the final sample (None: stopped short)
    final_val_se: float | None = None  # the final loss's sampling standard error over that sample
    #: the final sample's per-batch (summed nats, tokens): paired sampling errors between runs
    final_val_batches: list[list[float]] | None = None


# ---- schedule ----------------------------------------------------------------------------------
def lr_at(step: int, cfg) -> float:
    """Learning rate at ``step`` (0-based): linear warmup, then cosine / warmup-stable-decay."""
    peak, floor, warmup = cfg.lr, cfg.lr * cfg.min_lr_ratio, cfg.warmup
    if step < warmup:
        return peak * (step + 1) / warmup
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        frac = (step - warmup) / max(1, cfg.steps - warmup)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    decay_start = cfg.steps - int(cfg.decay_frac * cfg.steps)  # wsd
    if step < decay_start:
        return peak
    frac = (step - decay_start) / max(1, cfg.steps - decay_start)
    return peak + (floor - peak) * min(1.0, frac)


def make_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, gains, coupling vectors, queries)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=device.type == "cuda")


# ---- optimizer state <-> safetensors (no pickle) ------------------------------------------------
def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"state.{idx}.{k}"] = v.detach().cpu().contiguous()
    # With train.cuda_graph the learning rate is a device tensor; JSON holds its value.
    groups = [{k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in g.items()}
              for g in sd["param_groups"]]
    return tensors, {"param_groups": groups}


def _load_optim(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        if not name.startswith("state."):
            continue
        _, idx, k = name.split(".", 2)
        state.setdefault(int(idx), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# ---- the run -----------------------------------------------------------------------------------
def resolve_fused_readout(tc: TrainConfig, model) -> bool:
    """``train.fused_readout``, with None (auto) resolved by the model's rows kind: on where its
    ``fused_readout_by_default`` says the statistics-only loss pays (the same loss either way)."""
    if tc.fused_readout is not None:
        return tc.fused_readout
    return bool(getattr(model.rows, "fused_readout_by_default", False))


class Run:
    """One training run in this process. ``dist``: this process's place in a distributed run
    (``archlab.train.distributed.setup``), or None for a single process; the model is then
    wrapped (DDP/FSDP), each step takes this rank's rows of the global batch, and checkpoints
    are sharded (``archlab.io.dcp``)."""

    def __init__(self, cfg: RunConfig, out_dir: Path, dist: distributed.DistEnv | None = None):
        from archlab.data.loader import TokenData

        self.cfg, self.out, self.dist = cfg, Path(out_dir), dist
        tc = cfg.train
        self.data = TokenData(cfg.data.path)
        self.data.check_model_vocab(cfg.model.vocab_size)
        self.device = dist.device if dist is not None else resolve_device(tc.device)
        if tc.threads:
            torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)  # the same seed on every rank: identical initial weights
        self.model = build_model(cfg.model).to(self.device)
        # a new run's starting weights (before wrapping: every rank loads the same full tensors)
        fresh = not (self.out / "ckpt" / "latest").exists()
        self.initialised_from = self._init_weights(Path(tc.init_from)) if tc.init_from and fresh else None
        if dist is not None:
            self.model = distributed.wrap(self.model, tc, dist)
        self.opt = make_optimizer(self.model, tc, self.device)
        use_bf16 = tc.dtype == "bfloat16" or (tc.dtype == "auto" and self.device.type == "cuda")
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext())
        if dist is None and tc.activation_checkpointing:
            distributed.prepare_blocks(self.model, dataclasses.replace(tc, compile=False))
        # Distributed, compilation is per block (distributed.wrap): a graph per block is what
        # DDP's bucketing and FSDP's per-block gathers work with.
        self.step_fn = torch.compile(self.model) if tc.compile and dist is None else self.model
        self.fused_readout = resolve_fused_readout(tc, distributed.unwrap(self.model))
        self.graphed = GraphedStep(self._update, self.opt, self.device) if tc.cuda_graph else None
        self.step = 0
        self.last_eval = None  # the latest evaluate()'s CorpusScore

    @property
    def is_main(self) -> bool:
        """Whether this process writes logs, metrics and the checkpoint's shared files."""
        return self.dist is None or self.dist.is_main

    # The whole training step. Returns the loss as a tensor: reading it would make the host wait
    # for the device, so the loop reads it one step later, while the next step is already queued.
    def train_step(self, step: int) -> torch.Tensor:
        tc = self.cfg.train
        # for a model that changes over the run (layer dropout's probabilities decay)
        distributed.unwrap(self.model).set_training_progress(step / tc.steps)
        batches = []
        for micro in range(tc.grad_accum):
            x, y = self.data.train_batch(step, micro, tc.batch_size, tc.seq_len, self.cfg.data.seed)
            if self.dist is not None:  # this rank's rows of the batch one process would draw
                x, y = self.dist.rows(x), self.dist.rows(y)
            batches.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        if self.graphed is not None:  # the same update, replayed as one CUDA graph
            self.graphed.set_lr(lr_at(step, tc))
            return self.graphed(batches)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, tc)
        return self._update(batches)

    def _update(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward over the micro-batches, clipping, AdamW; the mean loss."""
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            with self.autocast:
                loss = self.step_fn(x, y, return_logits=not self.fused_readout).loss / len(batches)
            loss.backward()
            total += loss.detach()
        # Gradients are already averaged over the ranks here (DDP, FSDP), so the norm is the
        # global batch's; under FSDP it is computed over the sharded gradients (DTensors).
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total if self.dist is None else self.dist.mean(total)  # the global batch's loss

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Mean readout NLL (nats/token) and bits per byte on a fixed set of validation windows.

        Bits per byte divides by the bytes of exactly the scored tokens; a split shorter than
        train.eval_batches asks for is scored once, not wrapped, and said so once on stderr.
        ``last_eval`` keeps the full measurement (tokens and bytes scored)."""
        from archlab.eval.corpus import clipped_note, score_validation

        tc = self.cfg.train
        score = score_validation(self.model, self.data, tc.eval_batches, tc.batch_size, tc.seq_len,
                                 device=self.device, autocast=lambda: self.autocast, ranks=self.dist)
        if score.clipped and self.last_eval is None and self.is_main:
            _to_stderr(clipped_note(score, self.data.path) + "; lower train.eval_batches to silence this")
        self.last_eval = score
        return score.loss, score.bpb

    @torch.no_grad()
    def evaluate_final(self):
        """The final evaluation (``archlab.eval.corpus.score_final``): the run's final loss."""
        from archlab.eval.corpus import score_final

        return score_final(self.model, self.data, self.cfg.train, device=self.device,
                           autocast=lambda: self.autocast, ranks=self.dist)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self, step: int) -> None:
        if self.dist is not None:
            return self._save_sharded(step)
        otensors, ometa = optimizer_tensors(self.opt)
        otensors["rng.cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            otensors["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        state = {"config": self.cfg.to_dict(), "config_hash": self.cfg.hash(), "step": step,
                 "optimizer": ometa, "data": self._data_state()}
        root = self.out / "ckpt"
        name = f"step_{step:07d}"
        ckpt_io.write_checkpoint(root / name, {"model": ckpt_io.model_tensors(self.model), "optim": otensors}, state,
                                 {"tokenizer.json": self.data.tokenizer_path})
        ckpt_io.atomic_write_text(root / "latest", name + "\n")
        self._prune(root, name)

    def _data_state(self) -> dict[str, Any]:
        """What a checkpoint records of its data: the path and seed, and the fingerprint a resume
        checks (``archlab.io.run_dir``), which binds the run to the tokens it was trained on."""
        return {"path": self.cfg.data.path, "seed": self.cfg.data.seed,
                "fingerprint": run_dir.data_fingerprint(self.data.manifest)}

    def _prune(self, root: Path, name: str) -> None:
        kept = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in kept[: -self.cfg.train.keep_ckpts]:
            if old.name != name:
                import shutil
                shutil.rmtree(old, ignore_errors=True)

    def _save_sharded(self, step: int) -> None:
        """Every rank writes its shards (collective); rank 0 the shared files and ``latest``.
        The run's last checkpoint also holds the gathered weights (``model.safetensors``), so
        eval, generate and serve read it as they read a one-process checkpoint."""
        d = self.dist
        root, name = self.out / "ckpt", f"step_{step:07d}"
        tmp_name = d.broadcast_text(dcp_io.pick_temporary(root / name) if d.is_main else "")
        state = {"config": self.cfg.to_dict(), "config_hash": self.cfg.hash(), "step": step,
                 "data": self._data_state()}
        dcp_io.save(root / name, self.model, self.opt, state, {"tokenizer.json": self.data.tokenizer_path},
                    rank=d.rank, world_size=d.world_size, tmp_name=tmp_name, barrier=d.barrier,
                    full_model=step == self.cfg.train.steps)
        if d.is_main:
            ckpt_io.atomic_write_text(root / "latest", name + "\n")
            self._prune(root, name)
        d.barrier()  # ``latest`` names the new checkpoint before anyone goes on

    def _init_weights(self, path: Path) -> Path:
        """Load ``train.init_from``'s weights into the fresh model (keys and shapes must match;
        every file checked against its sha256); the checkpoint directory."""
        ck = ckpt_io.resolve_checkpoint(path)
        state = ckpt_io.read_state(ck)
        if dcp_io.is_sharded(state) and "model.safetensors" not in state.get("files", {}):
            raise CheckpointError(f"train.init_from: {ck} is sharded; write its weights as safetensors first: "
                                  f"archlab checkpoint consolidate {ck} --out DIR")
        ckpt_io.load_weights(self.model, ckpt_io.load_tensors(ck, "model"), ck)
        return ck

    def try_resume(self) -> bool:
        try:
            ck = ckpt_io.resolve_checkpoint(self.out)
        except CheckpointError:
            if (self.out / "ckpt" / "latest").exists():
                raise
            return False
        state = ckpt_io.read_state(ck)
        if state.get("config_hash") != self.cfg.hash():
            raise CheckpointError(self._config_refusal(state))
        # A checkpoint written before runs recorded their data has no fingerprint: it resumes as
        # it always did (nothing to compare with).
        run_dir.check_same_data(state.get("data", {}).get("fingerprint"),
                                run_dir.data_fingerprint(self.data.manifest), run=self.out, ckpt=ck,
                                data_path=self.cfg.data.path)
        if dcp_io.is_sharded(state):  # any number of processes, this one included
            otensors = dcp_io.load(ck, state, self.model, self.opt, rank=self.dist.rank if self.dist else 0)
        elif self.dist is not None:  # a one-process checkpoint resumed by several processes
            otensors = ckpt_io.load_tensors(ck, "optim")
            distributed.load_full_state(self.model, self.opt, ckpt_io.load_tensors(ck, "model"), otensors,
                                   state["optimizer"]["param_groups"])
        else:
            ckpt_io.load_weights(self.model, ckpt_io.load_tensors(ck, "model"), ck)
            otensors = ckpt_io.load_tensors(ck, "optim")
            _load_optim(self.opt, {k: v.to(self.device) if k.startswith("state.") and v.dim() > 0 else v
                                   for k, v in otensors.items()}, state["optimizer"])
        torch.set_rng_state(otensors["rng.cpu"])
        if self.device.type == "cuda" and "rng.cuda" in otensors:
            torch.cuda.set_rng_state(otensors["rng.cuda"], self.device)
        self.step = int(state["step"])
        return True

    def _config_refusal(self, state: dict[str, Any]) -> str:
        """Why a checkpoint of another config is not resumed: the keys that differ, and what to do
        instead (never ``--resume never``: a directory holding a checkpoint refuses that too)."""
        changes = run_dir.config_changes(state.get("config") or {}, self.cfg.to_dict())
        what = (run_dir.describe_changes(changes) if changes else  # every key equal: hashed another way
                f"hash {state.get('config_hash')} vs {self.cfg.hash()}, computed by another archlab version")
        own = self.out / "config.yaml"
        keep = f"; to continue that run: archlab train --config {own} --out {self.out}" if own.is_file() else ""
        return (f"{self.out} holds a run with another config ({what}); to train this config, train it "
                f"into another --out{keep}")


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)  # sys.stderr looked up now: a live rich display redirects it


def _record(line: str) -> dict[str, Any] | None:
    """One line of metrics.jsonl as a record, or None when it is not one."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(rec, dict) and isinstance(rec.get("kind"), str) and isinstance(rec.get("step"), int)
    return rec if ok else None


def read_metrics(path: Path) -> tuple[list[tuple[dict[str, Any], str]], str | None]:
    """The records of a metrics.jsonl, each with its line, and its torn last line (or None).

    A kill while a record is written leaves a partial last line: a record that was never
    finished, dropped here (a reader of a live run may also just catch a line half-written).
    A bad line anywhere else was damaged afterwards and is an error naming the file and line.
    """
    try:
        text = path.read_text(encoding="utf-8", errors="replace")  # a torn write may end in garbage
    except FileNotFoundError:
        return [], None
    lines = [(no, line) for no, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for i, (no, line) in enumerate(lines):
        rec = _record(line)
        if rec is None:
            if i == len(lines) - 1:
                return records, line
            raise ArchlabError(f"{path} line {no} is not a metrics record ({line[:40]!r}); the log was "
                               "damaged after it was written: repair or delete that line and run again")
        records.append((rec, line))
    return records, None


class MetricsLog:
    """metrics.jsonl (truncated to the resumed step, so a resumed run has one clean curve) plus
    TensorBoard events when tensorboard is installed."""

    def __init__(self, out: Path, resume_step: int, notify: Callable[[str], None] = _to_stderr):
        self.path = out / "metrics.jsonl"
        if self.path.exists():
            keep: list[str] = []
            if resume_step:  # a fresh start keeps nothing, so there is nothing to read
                records, torn = read_metrics(self.path)
                if torn is not None:
                    notify(f"dropped a torn last record of {self.path} (the run was stopped while "
                           f"writing it): {torn[:40]!r}")
                keep = [line for rec, line in records if rec["step"] <= resume_step]
            ckpt_io.atomic_write_text(self.path, "".join(line + "\n" for line in keep))
        self.f = open(self.path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tb"), purge_step=resume_step + 1 if resume_step else None)
        except ImportError:
            self.tb = None

    def write(self, rec: dict[str, Any]) -> None:
        with ckpt_io.full_disk_is_an_error(self.path, "the run's checkpoints are kept"):
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if k not in ("step", "kind", "tokens") and isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(f"{rec['kind']}/{k}", v, rec["step"])

    def close(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass  # only a full disk's unflushed tail: the error that stopped the run is the one to show
        if self.tb is not None:
            self.tb.close()


def read_curves(out: Path) -> tuple[list[dict], list[dict]]:
    """The train and val records of a run's metrics.jsonl (a torn last line left out)."""
    curves: dict[str, list[dict]] = {"train": [], "val": []}
    records, _ = read_metrics(Path(out) / "metrics.jsonl")
    for rec, _line in records:
        if rec["kind"] in curves:
            curves[rec["kind"]].append(rec)
    return curves["train"], curves["val"]


def read_final(out: Path, step: int) -> dict[str, Any] | None:
    """The ``final`` record of a run's metrics.jsonl written at ``step``, or None."""
    records, _ = read_metrics(Path(out) / "metrics.jsonl")
    found = [rec for rec, _line in records if rec["kind"] == "final" and rec["step"] == step]
    return found[-1] if found else None


def train(cfg: RunConfig, out_dir: str | Path, *, resume: bool = True, progress=None,
          stop_after_steps: int | None = None, show_progress: bool = True,
          notify: Callable[[str], None] = _to_stderr) -> TrainResult:
    """Train ``cfg`` into ``out_dir``; continue from its latest checkpoint when ``resume``.

    ``progress``: a rich ``Progress`` to add this run's task to (the lab shows many runs in one);
    ``stop_after_steps``: leave after that many steps of this call (as if interrupted);
    ``notify``: where one-line notices go (resuming, a torn log record dropped); stderr by default.

    Under torchrun (``WORLD_SIZE`` > 1) every process calls this: they form one run over the
    global batch (``archlab.train.distributed``); rank 0 alone logs, shows progress and writes
    the metrics, and a failure on any rank ends every rank with one line.
    """
    out = Path(out_dir)
    env = distributed.setup(cfg.train)  # checks the config against the world size first
    try:
        run = Run(cfg, out, env)  # validates data and device before anything is written
        # One writer per run directory (archlab.io.run_dir), claimed before its checkpoints are
        # read; under torchrun the run's rank 0 claims it for all its ranks.
        with run_dir.claim_run_dir(out, notify) if run.is_main else nullcontext(), \
                (_StopRequest.installed() if env is None else nullcontext(None)) as stop:
            return _train(run, resume=resume, progress=progress, stop_after_steps=stop_after_steps,
                          show_progress=show_progress, notify=notify, stop=stop)
    except BaseException as e:
        if env is None:
            raise
        raised = distributed.rank_error(env, e)
        env = None  # a group whose peer is gone may hang on destroy: the process exit ends it
        if raised is e:
            raise
        raise raised from None
    finally:
        distributed.teardown(env)


class _StopRequest:
    """Ctrl-C or SIGTERM during training: finish the step on the device, save a checkpoint at
    it, then leave as an interrupt does. A run on a machine lent for minutes at a time (a
    ``compare`` stopped by ``timeout``, its ``--jobs`` workers sent SIGTERM) then resumes where it
    stopped, not at its last ``ckpt_every`` checkpoint; a 57M-token run with checkpoints every
    500 steps would otherwise lose up to 500 steps to every stop. A second signal stops at once,
    and so does the first before this process has finished a step: there is nothing new to save
    then, and the first step (compilation, CUDA graph capture) can take minutes.

    One stop often arrives twice: Ctrl-C and ``timeout`` signal the whole process group, and
    ``compare`` then sends its workers SIGTERM as well. A signal within ``SAME_REQUEST_S`` of
    the first is taken for the same request, so that only a deliberate second one skips the save.

    Only for a run in one process: ranks under torchrun could see the signal at different steps,
    and a checkpoint is collective there. Outside the main thread no handler can be set, and
    the run keeps the default behaviour. A signal the process was started ignoring (``nohup``,
    ``cmd &`` in a script) stays ignored: whoever started it asked for that."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    SAME_REQUEST_S = 2.0

    def __init__(self) -> None:
        self.signum: int | None = None
        self.first_at = 0.0
        self.armed = False  # set once this process has trained a step worth saving

    @classmethod
    @contextmanager
    def installed(cls):
        if threading.current_thread() is not threading.main_thread():
            yield None
            return
        request = cls()
        previous = {sig: handler for sig in cls.SIGNALS if (handler := signal.getsignal(sig)) is not signal.SIG_IGN}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

        def handle(signum: int, frame: object) -> None:  # noqa: ARG001
            now = time.monotonic()
            if request.signum is not None and now - request.first_at < cls.SAME_REQUEST_S:
                return  # the same stop, delivered twice
            if request.signum is not None or not request.armed:  # stop now, without a checkpoint
                restore()
                raise KeyboardInterrupt(f"stopped by signal {signum}")
            request.signum, request.first_at = signum, now

        for sig in previous:
            signal.signal(sig, handle)
        try:
            yield request
        finally:
            restore()


class _NoLog:
    """The metrics log of a rank other than 0 (rank 0 writes the run's one log)."""

    def write(self, rec: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _train(run: Run, *, resume: bool, progress, stop_after_steps: int | None, show_progress: bool,
           notify: Callable[[str], None], stop: _StopRequest | None = None) -> TrainResult:
    cfg, out, tc = run.cfg, run.out, run.cfg.train
    if not run.is_main:
        notify = lambda message: None  # noqa: E731 (rank 0 says it once)
    resumed = run.try_resume() if resume else False
    if not resumed and (out / "ckpt" / "latest").exists():
        raise CheckpointError(f"{out} already holds a checkpoint; resume it or choose another --out")
    # Temporaries of killed runs in this directory: on a full disk they would fail every retry.
    if run.is_main:
        for folder in (out, out / "ckpt"):
            ckpt_io.remove_stale_temporaries(folder)
    if resumed:
        notify(f"resuming from step {run.step} of {out}")
    elif run.initialised_from is not None:
        notify(f"starting from the weights of {run.initialised_from} (train.init_from); the optimizer and the "
               "schedule start at step 0")
    out.mkdir(parents=True, exist_ok=True)
    if not resumed and run.is_main:
        ckpt_io.atomic_write_text(out / "config.yaml", dump_yaml(cfg))
    log = MetricsLog(out, run.step, notify) if run.is_main else _NoLog()
    world = run.dist.world_size if run.dist is not None else 1
    peak = peak_flops(run.device)
    peak = peak * world if peak else peak  # MFU of the whole run: all its devices
    flops_tok = mfu_flops_per_token(cfg.model, tc.seq_len)
    params = param_counts(cfg.model)["params_total"]
    bar = TrainProgress(progress, total_steps=tc.steps, start_step=run.step, tokens_per_step=tc.tokens_per_step,
                        label=out.name, enabled=show_progress and run.is_main)
    t_start, steps_done = time.perf_counter(), 0
    pending: tuple[int, torch.Tensor | float, float] | None = None  # (step, loss, tokens/s) not yet read

    def settle() -> None:
        """Read the pending step's loss: stop on a non-finite one, else log it."""
        nonlocal pending
        if pending is None:
            return
        step, loss_t, tok_s = pending
        pending = None
        loss = float(loss_t)
        if not math.isfinite(loss):
            raise TrainingDiverged(
                f"training diverged: loss is {loss} at step {step - 1}; the last good checkpoint "
                f"in {out / 'ckpt'} is kept (try a lower train.lr or a longer warmup)")
        bar.update(step, loss, tok_s)
        if step % tc.log_every == 0 or step == tc.steps:
            mfu = tok_s * flops_tok / peak if peak else None
            log.write({"kind": "train", "step": step, "tokens": step * tc.tokens_per_step, "loss": loss,
                       "lr": lr_at(step - 1, tc), "tokens_per_s": tok_s, "mfu": mfu})

    try:
        t_prev = time.perf_counter()
        while run.step < tc.steps:
            if stop_after_steps is not None and steps_done >= stop_after_steps:
                break
            loss_t = run.train_step(run.step)
            run.step += 1
            steps_done += 1
            if stop is not None:
                stop.armed = True
            settle()  # the previous step's loss, while this step runs on the device
            now = time.perf_counter()
            pending = (run.step, loss_t, tc.tokens_per_step / max(now - t_prev, 1e-9))
            t_prev = now
            if run.step % tc.eval_every == 0 or run.step % tc.ckpt_every == 0 or run.step == tc.steps:
                settle()  # never evaluate or checkpoint weights that a non-finite step produced
            if run.step % tc.eval_every == 0 or run.step == tc.steps:
                vl, bpb = run.evaluate()
                log.write({"kind": "val", "step": run.step, "tokens": run.step * tc.tokens_per_step,
                           "loss": vl, "bpb": bpb, "val_tokens": run.last_eval.tokens, **_bound(run.last_eval)})
                bar.note(f"val {vl:.3f}")
            if run.step % tc.ckpt_every == 0 or run.step == tc.steps:
                run.save(run.step)
            elif stop is not None and stop.signum is not None:
                settle()
                run.save(run.step)
                notify(f"stopped by signal {stop.signum} at step {run.step} of {tc.steps}: checkpoint saved "
                       f"in {out / 'ckpt'}; run the same command again to continue")
            if stop is not None and stop.signum is not None and run.step < tc.steps:
                raise KeyboardInterrupt(f"stopped by signal {stop.signum}")
        settle()
        final = _final_evaluation(run, out, log) if run.step == tc.steps else None
    finally:
        bar.close()
        log.close()
        run.graphed = None  # free a CUDA graph's memory pool now, not at some later garbage collection
    wall = time.perf_counter() - t_start
    if run.dist is not None:
        run.dist.barrier()  # rank 0's metrics are complete before every rank reads them
    train_curve, val_curve = read_curves(out)
    tokens_per_s = steps_done * tc.tokens_per_step / wall if wall > 0 and steps_done else 0.0
    if final is not None:
        final_loss, final_bpb = final["loss"], final["bpb"]
    elif val_curve and val_curve[-1]["step"] == run.step:
        final_loss, final_bpb = val_curve[-1]["loss"], val_curve[-1]["bpb"]
    else:
        final_loss, final_bpb = run.evaluate()
    return TrainResult(
        final_val_loss=final_loss, final_val_bpb=final_bpb, val_curve=val_curve, train_curve=train_curve,
        tokens=run.step * tc.tokens_per_step, steps=run.step, tokens_per_s=tokens_per_s, wall_s=wall,
        device=device_name(run.device),
        mfu=(tokens_per_s * flops_tok / peak) if peak and tokens_per_s else None, params=params,
        final_val_tokens=None if final is None else final["val_tokens"],
        final_val_se=None if final is None else final["se"],
        final_val_batches=None if final is None else final.get("batches_nats_tokens"))


def _final_evaluation(run: Run, out: Path, log: "MetricsLog | _NoLog") -> dict[str, Any]:
    """The finished run's final evaluation: its ``final`` record in metrics.jsonl, computed and
    written once (a finished run resumed again reads it back instead of evaluating again; under
    torchrun every rank evaluates, since the evaluation is collective)."""
    step = run.cfg.train.steps
    if run.dist is None:
        found = read_final(out, step)
        if found is not None:
            return found
    score = run.evaluate_final()
    rec = {"kind": "final", "step": step, "tokens": step * run.cfg.train.tokens_per_step, "loss": score.loss,
           "bpb": score.bpb, "val_tokens": score.tokens, "batches": score.batches, "se": score.se,
           "batches_nats_tokens": [[n, t] for n, t in zip(score.batch_nats, score.batch_tokens)], **_bound(score)}
    log.write(rec)
    return rec


def _bound(score) -> dict[str, Any]:
    """A record's mark that its loss and bits per byte are upper bounds (a diffusion model's
    negative ELBO), so that nobody reads them as exact likelihoods beside a baseline's."""
    return {"bpb_bound": score.bpb} if getattr(score, "bound", False) else {}
