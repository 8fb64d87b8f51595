"""The server's engine thread: ``EngineLoop`` owns the engine and its scheduler. Requests from any
number of HTTP connections queue there and share the running decode batch; other work on the
model (scoring a prompt for ``echo``) runs there too, between two steps."""

import concurrent.futures
import queue
import sys
import threading
from collections import deque
from typing import Any, Callable

from archlab.infer.engine import Engine, Request, Scheduler


#: How long a thread may hold the GIL while another waits for it. CPython's default, 5 ms, is
#: longer than a decode step: the engine thread, back from the GPU with the step's tokens, can
#: wait for the event loop to reach the end of its interval before it hands them out and starts
#: the next step (docs/benchmarks.md, "The server's host path on the CPU VM").
ENGINE_SWITCH_INTERVAL_S = 0.0002


def favour_the_engine_thread() -> None:
    """Shorten the interpreter's switch interval to ``ENGINE_SWITCH_INTERVAL_S`` (never lengthen
    it): process-wide, as the GIL is; the server's process runs the engine and its HTTP loop."""
    if sys.getswitchinterval() > ENGINE_SWITCH_INTERVAL_S:
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)


class QueueFull(Exception):
    """Every slot is busy and ``max_waiting`` requests already wait for one."""


class EngineFailed(Exception):
    """The engine thread died; no request can run any more."""


class EngineLoop:
    """The engine's thread: takes submitted requests, admits, steps, hands out tokens.

    It also keeps the counts that bound the wait queue and that /metrics reports: requests
    waiting for a slot (``queue_length``), slots holding a request (``slots_in_use``) and both
    together (``in_engine``). Handlers add to ``in_engine`` as they submit; the engine thread
    recounts all three after each admission, under the same lock, so a burst of submissions
    between two steps cannot pass the bound."""

    def __init__(self, engine: Engine, pipelined: bool = True):
        self.engine = engine
        # ``pipelined``: each step is launched before the previous one's tokens are handed out
        # (``Scheduler.step_once``); False only to measure what that overlap gains
        self.pipelined = pipelined
        self.scheduler = Scheduler(engine)
        self.inbox: queue.Queue[Request] = queue.Queue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="archlab-engine", daemon=True)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self.in_engine = self.queue_length = self.slots_in_use = 0
        self.jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()

    def start(self) -> "EngineLoop":
        favour_the_engine_thread()
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put_nowait(None)  # type: ignore[arg-type]  # wakes a waiting loop
        self.thread.join(timeout=10)

    def submit(self, request: Request, max_waiting: int | None = None) -> None:
        """Validate (raising ValueError for a bad request) and queue for the engine thread;
        ``QueueFull`` when every slot is busy and ``max_waiting`` requests wait already."""
        self.scheduler.check(request)
        with self._lock:
            if self.error is not None:
                raise EngineFailed(f"the engine failed: {self.error!r}")
            if max_waiting is not None and self.in_engine >= self.engine.slots + max_waiting:
                raise QueueFull(f"the server is busy: every slot is decoding and the queue of {max_waiting} "
                                f"waiting requests is full (--max-queue); retry later")
            self.in_engine += 1
            self.queue_length += 1
            self.inbox.put(request)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """``fn()`` run on the engine thread between two steps (the model is the engine's: a
        forward of its own, such as scoring a prompt for ``echo``, must not run beside a step)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:
                raise EngineFailed(f"the engine failed: {self.error!r}")
            self.jobs.append((fn, future))
        self.inbox.put_nowait(None)  # type: ignore[arg-type]  # wakes a waiting loop
        return future

    def _run_jobs(self) -> None:
        while self.jobs:
            fn, future = self.jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # the caller's to report; the engine itself is fine
                    future.set_exception(e)

    def _take(self, block: bool) -> None:
        try:
            r = self.inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while r is not None:
            self.scheduler.waiting.append(r)
            try:
                r = self.inbox.get_nowait()
            except queue.Empty:
                r = None

    def _drop_cancelled(self) -> None:
        """Requests cancelled while they wait (their client left or their time ran out) leave the
        queue now: the scheduler drops them only when a slot frees, and until then they would
        count against ``--max-queue``."""
        waiting = self.scheduler.waiting
        if any(r.cancelled for r in waiting):
            for r in waiting:
                if r.cancelled:
                    r.finish_reason = "cancelled"
            self.scheduler.waiting = deque(r for r in waiting if not r.cancelled)

    def _recount(self) -> None:
        with self._lock:  # puts into the inbox happen under this lock: its size is exact here
            waiting = self.inbox.qsize() + len(self.scheduler.waiting)
            self.queue_length, self.slots_in_use = waiting, len(self.scheduler.running)
            self.in_engine = waiting + self.slots_in_use

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take(block=self.scheduler.idle and not self.jobs)
                self._run_jobs()
                self._drop_cancelled()
                self.scheduler.admit()
                self._recount()
                if self.scheduler.busy:
                    self.scheduler.step_once(pipelined=self.pipelined)
        except BaseException as e:  # reported to every request in flight; later ones are refused
            with self._lock:  # no submission after this: each one checks ``error`` under the lock
                self.error = e
            self._take(block=False)
            while self.jobs:
                self.jobs.popleft()[1].set_exception(EngineFailed(f"the engine failed: {e!r}"))
            for r in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
                r.finish_reason = "error"
                if r.on_token is not None:
                    r.on_token(r, -1)
