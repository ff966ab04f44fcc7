"""The engine thread of a worker: every engine mutation happens here, between steps.

Services never touch the LLMEngine from their own threads; they ``call(fn)`` and get a
concurrent.futures.Future with ``fn(engine)``'s result. After each step ``on_step(out)`` is
called on this thread; ``before_step()`` runs before each step (lease and deadline expiry);
``observe_step(out, seconds)`` after every step, with how long ``engine.step()`` took (metrics).
A call runs in the caller's context (contextvars): what it logs or traces on this thread
carries the caller's request id and span.
``stats`` is the engine's counters as of the last step or call, refreshed on this thread, so a
stats reader never waits for the engine (a busy engine must not look like a dead one).
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdserve.common.engine.llm_engine import LLMEngine, StepOutput
from pdserve.common.outputs import FinishReason

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05
T = TypeVar("T")


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[StepOutput], None],
                 before_step: Callable[[], None] | None = None,
                 observe_step: Callable[[StepOutput, float], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.before_step = before_step
        self.observe_step = observe_step
        self._calls: deque[tuple[Callable[[LLMEngine], Any], Future, contextvars.Context]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self.num_steps = 0
        # replaced whole, never mutated: safe to read anywhere
        self.stats: dict[str, int | float | bool] = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout)

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread before the next step."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopped:
                future.set_exception(RuntimeError("engine loop is stopped"))
                return future
            self._calls.append((fn, future, contextvars.copy_context()))
            self._wake.notify()
        return future

    def _run_calls(self) -> None:
        while True:
            with self._wake:
                if not self._calls:
                    return
                fn, future, context = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(context.run(fn, self.engine))
            except BaseException as e:  # the caller gets it through the future
                future.set_exception(e)

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._stopped:
                    break
                if not self._calls and not self.engine.has_unfinished():
                    self._wake.wait(IDLE_WAIT_S)
            self._run_calls()
            if self.before_step is not None:
                self.before_step()
            if not self.engine.has_unfinished():
                self.stats = self.engine.stats()
                continue
            started = time.perf_counter()
            try:
                out = self.engine.step()
            except Exception:
                logger.exception("engine step failed; failing every request in flight")
                out = StepOutput(is_prefill=False, finished=self._fail_all())
            else:
                if self.observe_step is not None:
                    self.observe_step(out, time.perf_counter() - started)
            self.num_steps += 1
            if out.seqs or out.finished:
                self.on_step(out)
            self.stats = self.engine.stats()
        self._run_calls()
        self.stats = self.engine.stats()

    def _fail_all(self) -> list:
        failed = []
        for request_id in list(self.engine.requests):
            seq = self.engine.abort(request_id, FinishReason.ERROR)
            if seq is not None:
                failed.append(seq)
        return failed
