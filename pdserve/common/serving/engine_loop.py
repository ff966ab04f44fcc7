"""The engine thread of a worker: every engine mutation happens under the engine's state lock.

The engine thread holds :attr:`EngineLoop.state` for everything it does (scheduling, the hooks,
the calls queued with ``call``) except while the model computes (``ModelRunner.launch`` and the
wait for a launched step's tokens), and while it idles. Other threads ``call(fn)`` and get a
concurrent.futures.Future of ``fn(engine)`` run on the engine thread before the next step (calls
made before ``start`` run once it starts), in the caller's contextvars; or :meth:`EngineLoop.now`
/ :meth:`EngineLoop.try_now` run ``fn(engine)`` on their own thread as soon as the lock is free:
between steps or while a step computes, never behind a long prefill step. Such a function may
only touch what no computing step reads or writes: new requests (a reservation's free blocks, a
queued request), the handoff's records, requests that are not in a step (reserved, waiting);
anything a step may hold (a running sequence) is ended through ``call``.
``observe_step(out, seconds)`` runs after every step. ``stats`` is the engine's counters as of
the last step or call, so a reader never waits for the engine.
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


class StateLock:
    """The engine's state: the engine thread holds it except while the model computes; another
    thread waiting for it goes first (the engine thread takes it back only once no one else
    waits), so a short call never waits more than the engine's own bookkeeping between computes."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self._waiting = 0           # other threads blocked in acquire()
        self.owner: int | None = None

    def acquire(self, blocking: bool = True) -> bool:
        """Another thread's turn (priority over the engine thread)."""
        with self._cond:
            if self._held:
                if not blocking:
                    return False
                self._waiting += 1
                try:
                    while self._held:
                        self._cond.wait()
                finally:
                    self._waiting -= 1
            self._held = True
            self.owner = threading.get_ident()
            return True

    def acquire_engine(self) -> None:
        """The engine thread's turn: after every other thread waiting."""
        with self._cond:
            while self._held or self._waiting:
                self._cond.wait()
            self._held = True
            self.owner = threading.get_ident()

    def release(self) -> None:
        with self._cond:
            self._held = False
            self.owner = None
            self._cond.notify_all()

    def held_here(self) -> bool:
        return self._held and self.owner == threading.get_ident()


class EngineLoop:
    def __init__(self, engine: LLMEngine, observe_step: Callable[[StepOutput, float], None] | None = None) -> None:
        self.engine = engine
        self.hooks = EngineHooks()
        self.observe_step = observe_step
        self.state = StateLock()
        self._calls: deque[tuple[Callable[[LLMEngine], Any], Future, contextvars.Context]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self.num_steps = 0
        # replaced whole, never mutated: safe to read anywhere
        self.stats: dict[str, int | float | bool] = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._unlock_compute()

    def _unlock_compute(self) -> None:
        """Release the state lock while the model computes: around ``ModelRunner.launch`` (the
        forward itself on the CPU; the enqueue on a GPU) and a launched step's ``result`` (the
        wait for the device). Only on the engine thread holding the lock; elsewhere as is."""
        runner, state = self.engine.model_runner, self.state
        launch = runner.launch

        def unlocked(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
            if not state.held_here():
                return fn(*args, **kwargs)
            state.release()
            try:
                return fn(*args, **kwargs)
            finally:
                state.acquire_engine()

        def launch_unlocked(*args: Any, **kwargs: Any) -> LaunchedStep:
            if state.held_here():
                self.stats = self.engine.stats()    # what the step holds, for readers meanwhile
            launched = unlocked(launch, *args, **kwargs)
            result = launched.result
            launched.result = lambda: unlocked(result)    # type: ignore[method-assign]
            return launched

        runner.launch = launch_unlocked                    # type: ignore[method-assign]

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

    def on_engine_thread(self) -> bool:
        """Whether the caller is the engine thread (between steps: no step is computing)."""
        return threading.get_ident() == self._thread.ident

    def wake(self) -> None:
        """New work for the engine thread (a request queued by ``now``)."""
        with self._wake:
            self._wake.notify()

    def try_now(self, fn: Callable[[LLMEngine], T]) -> tuple[bool, T | None]:
        """(True, ``fn(engine)``) run here if the state lock is free at once, else (False, None)."""
        if not self.state.acquire(blocking=False):
            return False, None
        return True, self._locked(fn)

    def now(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` run here as soon as the state lock is free (never behind a step's compute)."""
        self.state.acquire()
        return self._locked(fn)

    def _locked(self, fn: Callable[[LLMEngine], T]) -> T:
        try:
            result = fn(self.engine)
            self.stats = self.engine.stats()
            return result
        finally:
            self.state.release()
            self.wake()

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
        idle = False
        while True:
            with self._wake:
                if self._stopped:
                    break
                if not self._calls and (idle or not self.engine.has_unfinished()):
                    self._wake.wait(IDLE_WAIT_S)
            self.state.acquire_engine()
            try:
                idle = self._iteration()
            finally:
                self.state.release()
        self.state.acquire_engine()
        try:
            self._run_calls()
            self.stats = self.engine.stats()
        finally:
            self.state.release()

    def _iteration(self) -> bool:
        """Calls, expiry, one step; True when the step had nothing to do (requests waiting for
        blocks that others hold): the thread then waits for news instead of spinning."""
        self._run_calls()
        self.hooks.before_step(self.engine)
        if not self.engine.has_unfinished():
            self.stats = self.engine.stats()
            return False
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
        return not (out.seqs or out.finished or out.num_computed_tokens or self.engine.pending is not None)

    def _fail_all(self) -> list:
        failed = []
        for request_id in list(self.engine.requests):
            seq = self.engine.abort(request_id, FinishReason.ERROR)
            if seq is not None:
                failed.append(seq)
        return failed
