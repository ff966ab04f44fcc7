"""One request end to end: choose workers, run an :class:`~pdserve.router.attempt.Attempt` (retrying
on other workers when it fails before the first token, up to ``MAX_ATTEMPTS`` tries in all), turn its steps into
:class:`~pdserve.router.output.TextOutput` (incremental detokenization, stop strings), enforce the
deadline, and make sure the workers hear about every early end (stop string, deadline, client gone).
Domain types only: the front ends' servicers convert to and from their wire messages.

One ``TextOutput`` per step (:meth:`~pdserve.router.attempt.Attempt.next`): everything the
worker sent for the request since the last message, merged (tokens, logprobs, one text delta,
the finish reason), so a router or client that falls behind sends fewer, larger messages, not
more of them late. The last one carries the finish reason and the token accounting.

Latency: between a request's arrival and its first worker rpc the flow does only what that rpc
needs (validation, placement, the request message); the rest (response headers to the client,
the deadline timer, the output processor, metrics, the Prefill request of a disaggregated
attempt) runs right after the rpc's send (:meth:`Flow.dispatched`), while the worker works.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

import grpc
import grpc.aio

from pdserve.common.grpc_utils import PdserveError, Unavailable
from pdserve.common.grpc_utils.convert import finish_reason_name
from pdserve.common.outputs import FinishReason, SequenceOutput
from pdserve.common.sampling_params import SamplingParams
from pdserve.router.admission import AdmissionGate
from pdserve.router.attempt import Attempt
from pdserve.router.failures import Cut, Retry
from pdserve.router.fleet_placement import fleet_workers
from pdserve.router.job import Job
from pdserve.router.metrics import RouterMetrics
from pdserve.router.mover import Mover
from pdserve.router.output import OutputProcessor, TextOutput
from pdserve.router.placement import Placement
from pdserve.router.settings import RouterSettings
from pdserve.router.slo import NONE, RequestSlo
from pdserve.router.tokenization import Prompt
from pdserve.router.workers import WorkerRegistry

log = logging.getLogger(__name__)

# Tries of one request before its first token (each on workers not tried yet, within the
# request's deadline): a worker killed or drained under load can fail a request's first try and
# a stalled peer its second; nothing has reached the client yet, so trying again is safe.
MAX_ATTEMPTS = 4


@dataclass(eq=False)
class _Run:
    """One request's attempts as :meth:`Flow.generate` runs them: the first, then any migrations
    or moves (pdserve.router.mover reads and marks it)."""

    job: Job
    att: Attempt | None = None       # the attempt now running (None: closed by a migration)
    cancel_workers: bool = True      # closing it cancels the request there (not once they finished it)
    generated: list[int] = field(default_factory=list)  # every token sent so far (a migration's prompt tail)
    migrations: int = 0
    cached: int | None = None        # the first attempt's, once a migration replaced it
    move_to: str | None = None       # a worker the mover wants it to go on at (set by the mover)
    moves: int = 0

    @property
    def decode_key(self) -> str | None:
        return self.att.decode.key if self.att is not None else None

    @property
    def tokens_left(self) -> int:
        return self.job.sampling.max_tokens - len(self.generated)


class Flow:
    def __init__(self, registry: WorkerRegistry, settings: RouterSettings, tokenizer, metrics: RouterMetrics) -> None:
        self.registry = registry
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._ids = itertools.count(1)
        self.placement = Placement(registry, settings)
        self.mover = Mover(lambda: fleet_workers(self.placement), settings.pd.slo_tpot_ms,
                           settings.pd.move_interval_s if self.placement.policy.moves_decodes else 0.0,
                           settings.pd.rate_window_s)
        self.admission = AdmissionGate(registry, settings, metrics)
        self._background: set[asyncio.Task] = set()
        self.inflight = 0
        self.draining = False

    def new_request_id(self) -> str:
        return f"{self.settings.router_id}-{next(self._ids)}"

    def make_job(self, request_id: str, prompt: Prompt, sampling: SamplingParams,
                 stop: tuple[str, ...], include_stop: bool,
                 skip_special_tokens: bool, time_remaining: float | None, slo: RequestSlo = NONE) -> Job:
        deadline = deadline_ms = None
        if time_remaining is not None:
            deadline = time.monotonic() + time_remaining
            deadline_ms = int((time.time() + time_remaining) * 1000)
        return Job(request_id, prompt, sampling, stop, include_stop, skip_special_tokens,
                   deadline, deadline_ms or 0, slo)

    # ---- background cancels -----------------------------------------------------------
    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _start(self, job: Job, excluded: set[str] | None = None,
                     forced: tuple[str, str] | None = None) -> tuple[Attempt, SequenceOutput]:
        """Start the request and wait for its first step; retried on other workers (each failed
        worker excluded) up to MAX_ATTEMPTS tries, while workers remain and the deadline allows.
        ``forced``: (decode worker, prefill worker) of the first try (a move)."""
        excluded = set() if excluded is None else excluded
        last: Retry | None = None
        for attempt_no in range(MAX_ATTEMPTS):
            job.matched = None          # the index may have changed since the last try
            try:
                t0 = time.perf_counter()
                decode, prefill, decision = self.placement.choose(job, excluded, forced if not attempt_no else None)
                self.metrics.decision.observe(time.perf_counter() - t0)
                self.metrics.pd.decided(decision.kind, decision.reason, decision.ttft_ms, decision.tpot_ms)
            except Unavailable:
                if last is not None:
                    raise last.cause from None
                raise
            att = Attempt(self, job, decode, prefill, self.new_request_id(), decision)
            try:
                await att.start()
                return att, await att.next()
            except Retry as r:
                att.close(cancel_workers=True)
                final = attempt_no == MAX_ATTEMPTS - 1 or job.expired()
                log.info("request %s: %s; %s", job.request_id, r.cause.message,
                         "giving up" if final else "retrying on another worker")
                excluded.add(r.worker_key)
                last = r
                if final:
                    break
                self.metrics.retries.inc()
            except BaseException:
                att.close(cancel_workers=True)
                raise
        assert last is not None
        raise last.cause

    def dispatched(self, att: Attempt) -> None:
        """``att``'s first worker rpc was just started (its send is the next thing the loop runs)."""
        att.job.dispatched()
        asyncio.get_running_loop().call_soon(self._after_send, att)

    def _after_send(self, att: Attempt) -> None:
        """Per-request set-up that the worker rpc does not need, run right after its send: on a
        CPU that idled before the request, every step of the path costs ~10x its warm time
        (cold caches), so whatever can wait for the worker does."""
        if att.closed:
            return
        att.after_send()
        job = att.job
        if att.timer is None:       # the worker rpcs carry their own timeouts until now
            att.timer = self._arm_deadline(job, att)
        self._open_output(job)

    def _open_output(self, job: Job) -> OutputProcessor:
        """The request's OutputProcessor, made (and the request counted in flight) once."""
        if job.output is None:
            job.output = OutputProcessor(self.tokenizer, job.stop, job.include_stop, job.skip_special_tokens,
                                         job.sampling.min_tokens)
            self.metrics.in_flight.inc()
            self.metrics.prompt_tokens.inc(len(job.prompt.token_ids))
        return job.output

    def _new_output(self, job: Job) -> OutputProcessor:
        """The OutputProcessor of another sample of ``job`` (SamplingParams.n > 1)."""
        return OutputProcessor(self.tokenizer, job.stop, job.include_stop, job.skip_special_tokens,
                               job.sampling.min_tokens)

    def _arm_deadline(self, job: Job, att: Attempt) -> asyncio.TimerHandle | None:
        remaining = job.remaining()
        if remaining is None:
            return None
        return asyncio.get_running_loop().call_later(remaining, att.expire)

    # ---- the request ------------------------------------------------------------------
    async def generate(self, job: Job, method: str = "Generate"
                       ) -> AsyncGenerator[TextOutput, None]:
        """The request's outputs, one per step; the last has its finish reason. Errors are
        pdserve.common.grpc_utils domain errors (or a worker's rpc error)."""
        if self.draining:
            raise Unavailable("the router is shutting down")
        # Overloaded (RESOURCE_EXHAUSTED) over a bound
        waiting = self.admission.admit(method, len(job.prompt.token_ids), job.slo.ttft_ms)
        started = time.monotonic()
        status = "UNKNOWN"
        run = _Run(job)
        self.inflight += 1
        try:
            run.att, step = await self._start(job)
            waiting.close()
            self.mover.track(run)
            outs = {0: self._open_output(job)}     # per sample; sample 0's made by _after_send, normally
            ended: set[int] = set()
            stopped = False
            first = True
            while True:
                i = step.index
                out = outs.get(i) or outs.setdefault(i, self._new_output(job))
                answer = None if i in ended else self._respond(
                    job, out, run.att.cached_tokens if run.cached is None else run.cached, step)
                if answer is not None:
                    resp, done, stop_hit = answer
                    resp.index = i
                    if first:       # observed after the yield: the message goes out first
                        first = False
                        ttft = time.monotonic() - started
                        yield resp
                        self.metrics.ttft.observe(ttft)
                    else:
                        yield resp
                    if done:
                        ended.add(i)
                        stopped = stopped or stop_hit     # the worker may still run that sample
                        self._count_finish(resp)
                        if len(ended) == job.sampling.n:
                            run.cancel_workers = stopped
                            break
                run.generated.extend(step.token_ids)
                step = await self._next_step(job, run)
            status = "OK"
        except asyncio.CancelledError:
            status = "DEADLINE_EXCEEDED" if job.expired() else "CANCELLED"
            raise
        except Retry as r:          # a step failed before any token went out
            status = r.cause.code.name
            raise r.cause from None
        except PdserveError as e:
            status = e.code.name
            raise
        except grpc.aio.AioRpcError as e:
            status = e.code().name
            raise
        finally:
            waiting.close()
            self._end_request(job, run, method, status, started)

    def _count_finish(self, resp: TextOutput) -> None:
        """Count the request's finish reason (its last output's)."""
        reason = finish_reason_name(resp.finish_reason, resp.matched_stop is not None)
        self.metrics.finish.labels(reason).inc()

    async def _next_step(self, job: Job, run: _Run) -> SequenceOutput:
        """The request's next step: from its attempt, or, when the attempt's stream was cut after
        its first token, from a migration to other workers (which replaces ``run.att``)."""
        assert run.att is not None
        if run.move_to is not None:
            dst, run.move_to = run.move_to, None
            if _can_continue(job, run.generated):
                return await self._move(job, run, dst)
        try:
            return await run.att.next()
        except Cut as cut:
            if not self._can_migrate(job, run.generated, run.migrations):
                raise cut.cause from None
            run.migrations += 1
            run.cached = run.att.cached_tokens if run.cached is None else run.cached
            run.att.close(cancel_workers=True)
            run.att = None
            run.att, step = await self._migrate(job, run.generated, cut)
            return step

    def _end_request(self, job: Job, run: _Run, method: str, status: str, started: float) -> None:
        """The request's end, however it ended: its attempt closed, its metrics counted."""
        self.mover.untrack(run)
        if run.att is not None:
            run.att.close(cancel_workers=run.cancel_workers)
        self.inflight -= 1
        if job.output is not None:      # counted in (see _after_send)
            self.metrics.in_flight.dec()
            self.metrics.output_tokens.inc(job.output.num_tokens)
        self.metrics.requests.labels(method, status).inc()
        self.metrics.e2e.observe(time.monotonic() - started)

    def _can_migrate(self, job: Job, generated: list[int], migrations: int) -> bool:
        """A stream cut after its first token may go on elsewhere: within the limit and
        :func:`_can_continue`."""
        return migrations < self.settings.migration_limit and _can_continue(job, generated)

    async def _migrate(self, job: Job, generated: list[int], cut: Cut) -> tuple[Attempt, SequenceOutput]:
        """The rest of ``job`` on other workers (:func:`_continuation`)."""
        log.info("request %s: %s after %d tokens; continuing on another worker", job.request_id,
                 cut.cause.message, len(generated))
        self.metrics.migrations.inc()
        return await self._start(_continuation(job, generated), {cut.worker_key})

    async def _move(self, job: Job, run: _Run, dst: str) -> SequenceOutput:
        """Go on with ``run`` on worker ``dst`` (pdserve.router.mover): the attempt on its decode
        worker ends (cancelled there), and the continuation is prefilled on that worker, whose
        prefix cache holds the request's blocks, and decoded on ``dst``; falls back to the
        placement's own choice when either worker is gone."""
        assert run.att is not None
        src = run.att.decode.key
        run.moves += 1
        run.cached = run.att.cached_tokens if run.cached is None else run.cached
        run.att.close(cancel_workers=True)
        run.att = None
        log.info("request %s: moving its decode from %s to %s after %d tokens", job.request_id, src, dst,
                 len(run.generated))
        run.att, step = await self._start(_continuation(job, run.generated), forced=(dst, src))
        return step

    def _respond(self, job: Job, out: OutputProcessor, cached_tokens: int, step: SequenceOutput
                 ) -> tuple[TextOutput, bool, bool] | None:
        """(output to send, request finished, finished by a stop string); None: nothing to send
        (and not finished)."""
        toks = step.token_ids
        text, matched = out.step(toks)
        reason = step.finish_reason
        done = reason is not None or matched is not None
        if done and matched is None:
            tail = out.finish()
            text, matched = text + tail.text, tail.matched_stop
        if matched is not None:
            reason = FinishReason.STOP
        if not done and not toks and not text:
            return None
        resp = TextOutput(job.request_id, toks, step.logprobs if job.sampling.logprobs else [], text=text)
        if job.sampling.logprobs:
            resp.top_logprobs = step.top_logprobs
            resp.prompt_logprobs, resp.prompt_top_logprobs = step.prompt_logprobs, step.prompt_top_logprobs
        if done:
            resp.finish_reason = reason
            resp.num_prompt_tokens = len(job.prompt.token_ids)
            resp.num_output_tokens = out.num_tokens
            resp.num_cached_tokens = cached_tokens
            resp.matched_stop = matched
            self.metrics.cached_tokens.inc(cached_tokens)
        stop_hit = matched is not None and step.finish_reason is None
        return resp, done, stop_hit

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; wait (up to grace_s) for those in flight."""
        self.draining = True
        end = time.monotonic() + grace_s
        while self.inflight and time.monotonic() < end:
            await asyncio.sleep(0.05)


def _continuation(job: Job, generated: list[int]) -> Job:
    """The rest of ``job``: its prompt followed by the tokens already sent as the new prompt, the
    tokens left as its budget; the output processor goes on as it was."""
    return replace(job, prompt=Prompt(job.prompt.token_ids + generated, job.prompt.field),
                   sampling=replace(job.sampling, max_tokens=job.sampling.max_tokens - len(generated),
                                    min_tokens=max(0, job.sampling.min_tokens - len(generated)),
                                    prompt_logprobs=False),     # sent once, with the first token
                   hash_chain=None, matched=None, on_dispatch=None, origin=job.origin or job)


def _can_continue(job: Job, generated: list[int]) -> bool:
    """Whether ``job`` may go on from its prompt + ``generated`` elsewhere: within the deadline,
    with tokens left to make, and only when that is the same request (presence / frequency
    penalties count output tokens only; a guide's grammar would start again from the new prompt;
    the samples of an n > 1 request went on from one prefill)."""
    s = job.sampling
    return (not job.expired() and len(generated) < s.max_tokens and s.n == 1
            and s.presence_penalty == 0.0 and s.frequency_penalty == 0.0 and s.guide is None)
