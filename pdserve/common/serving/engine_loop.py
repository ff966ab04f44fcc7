"""The engine thread of a worker: every engine mutation happens here, between steps.

Other threads ``call(fn)`` and get a concurrent.futures.Future of ``fn(engine)`` (calls made before
``start`` run once it starts), run in the caller's contextvars. ``observe_step(out, seconds)`` runs
after every step. ``stats`` is the engine's counters as of the last step or call, so a reader
never waits for the engine.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.common.engine.llm_engine import LLMEngine, StepOutput
from pdserve.common.engine.model_runner import LaunchedStep
from pdserve.common.engine.sequence import Sequence
from pdserve.common.outputs import FinishReason

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05
T = TypeVar("T")


def _no_step(out: StepOutput) -> None:
    pass


def _no_expiry(engine: LLMEngine) -> None:
    pass


@dataclass(frozen=True)
class EngineHooks:
    """What a role runs on the engine thread: ``on_step(out)`` after each step that produced
    tokens or finished requests; ``before_step(engine)`` before each step (lease and deadline
    expiry); ``on_prefill_launch(seqs, launched)`` right after a prefill step is launched
    (``LLMEngine.on_prefill_launch``: a KV send may start from there)."""
    on_step: Callable[[StepOutput], None] = _no_step
    before_step: Callable[[LLMEngine], None] = _no_expiry
    on_prefill_launch: Callable[[list[Sequence], LaunchedStep], None] | None = None

    @staticmethod
    def combine(first: EngineHooks, second: EngineHooks) -> EngineHooks:
        """Both roles' hooks, ``first``'s before ``second``'s (each ignores the other's requests)."""
        def on_step(out: StepOutput) -> None:
            first.on_step(out)
            second.on_step(out)

        def before_step(engine: LLMEngine) -> None:
            first.before_step(engine)
            second.before_step(engine)

        launches = [h.on_prefill_launch for h in (first, second) if h.on_prefill_launch is not None]

        def on_prefill_launch(seqs: list[Sequence], launched: LaunchedStep) -> None:
            for hook in launches:
                hook(seqs, launched)
        return EngineHooks(on_step, before_step, on_prefill_launch if launches else None)


class EngineLoop:
    def __init__(self, engine: LLMEngine, observe_step: Callable[[StepOutput, float], None] | None = None) -> None:
        self.engine = engine
        self.hooks = EngineHooks()
        self.observe_step = observe_step
        self._calls: deque[tuple[Callable[[LLMEngine], Any], Future, contextvars.Context]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self.num_steps = 0
        # replaced whole, never mutated: safe to read anywhere
        self.stats: dict[str, int | float | bool] = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self, hooks: EngineHooks) -> None:
        self.hooks = hooks
        self.engine.on_prefill_launch = hooks.on_prefill_launch
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread.ident is not None:    # started
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
            self.hooks.before_step(self.engine)
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
                self.hooks.on_step(out)
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
