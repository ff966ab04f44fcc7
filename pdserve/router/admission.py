"""Admission control: whether the router takes a new request now or refuses it at once.

Under a burst far above what the workers can prefill, queueing every request makes every TTFT
grow without bound; a request refused at once (gRPC RESOURCE_EXHAUSTED, HTTP 429 with
``Retry-After``) can go to another replica or come back later, and those admitted keep their
TTFT. The check runs where a request starts (``Flow.generate``, the one path of every front
door), before placement, so a refused request costs no worker rpc and reserves no KV.

:func:`decide` is a pure function over snapshots (:class:`Place`) of the places that could
prefill the request (the usable prefill-capable workers, roles prefill and both; the decode
workers instead under ``--pd-policy never`` or when no prefill-capable worker is up). Per
place ``w``::

    Q_w     prompt tokens queued on w: this router's, live, plus the other replicas' (last GetStats)
    R_w     w's prefill rate, tokens/s: the gate's kept figure (below); unknown (0): the mean of
            the known ones, else pd_policy.DEFAULT_PREFILL_TOKENS_PER_S
    t_w     ms the decode rows add to each of w's steps while w decodes: its decode_step_ms when
            it has requests running (its last GetStats, or this router's own), else 0
    B_w     prompt tokens one step of w carries (its max_num_batched_tokens; 0 = unknown: one step)

    T_w(n)  = 1000 * n / R_w + (ceil(n / B_w) + 1) * t_w     ms to prefill n prompt tokens on w (T_w(0) = 0)

and for the request (``U`` its prompt tokens, 0 when not given; ``S`` its TTFT objective: the
router's ``--slo-ttft-ms``, or the request's own when tighter; ``k`` = ``slo_multiple``)::

    ttft_w  = T_w(Q_w + U)                                the queue ahead of it, then its own prompt
    bound_w = max(k * S, T_w(U) + MIN_QUEUE_SHARE * k * S)

and over the fleet (``N`` places)::

    W       = max(own_waiting, reported_waiting)   waiting requests: this router's requests
              admitted and not yet at their first token (live), or the workers' engine queues
              (sum of num_waiting, last GetStats: the other replicas' requests too), the larger
              (each is a lower bound of the fleet's; their sum would count this router's twice)

A request is refused by the first rule that holds (reason in brackets), else admitted:

1. ``N == 0`` -> admitted (placement answers UNAVAILABLE, as without admission control).
2. [waiting-requests] ``max_waiting_requests > 0`` and ``W >= max_waiting_requests * N``:
   the bound is per worker, so the fleet takes ``N`` times it.
3. [queued-tokens] ``max_queued_prompt_tokens > 0`` and ``min_w Q_w >= max_queued_prompt_tokens``:
   every place already has that many prompt tokens queued.
4. [slo-ttft] ``k > 0`` and ``ttft_w > bound_w`` on every place: nowhere would the request
   meet ``k`` times its TTFT objective, and the queue is what makes it miss.

Every place must be over a bound for a refusal, so a request that some worker could still take
within the bounds is admitted (placement may still choose a busier worker for its cache). A
place with nothing queued never refuses (``ttft_w = T_w(U) <= bound_w``): a refusal must be
something waiting fixes. ``MIN_QUEUE_SHARE``: a request may always wait that share of ``k * S``
in the queue, so a prompt whose own prefill takes most of its objective (or more) is not
refused whenever anything at all is queued, which would starve long prompts under steady load;
a request whose own prefill takes at most ``1 - MIN_QUEUE_SHARE`` of ``k * S`` has the bound
``k * S`` itself.

``Retry-After`` (whole seconds, ``ceil`` of the estimate, clamped to 1..MAX_RETRY_AFTER_S): when
the best place's queue will have drained below the bound::

    waiting-requests   min_w T_w(Q_w) * (W - L + 1) / W        (L = max_waiting_requests * N: the
                                                                excess share of the queue)
    queued-tokens      min_w T_w(Q_w - max_queued_prompt_tokens)
    slo-ttft           min_w (ttft_w - bound_w)

Why the request's own prompt counts, and ``k`` is 1 by default: the request's TTFT is its queue
wait plus its own prefill; bounding the wait alone by a multiple of the objective admitted
requests whose TTFT was that multiple plus their own prefill, over the objective. With ``k = 1``
a request that cannot meet its TTFT objective is refused instead of queued, and an admitted one
meets it as far as the estimate holds. ``k > 1`` admits that much beyond it (refusing later);
``k < 1`` keeps a margin for the estimate's error. Without ``U`` (a caller that does not give
it) the rule bounds the queue wait alone by ``k * S``.

Why ``t_w``: a worker of role both prefills in steps that also carry its decode rows (chunked
prefill) and runs decode-only steps between prompts; the prompts queued there drain at its
prefill rate plus one decode step per prefill step, after the step in flight (a new prompt
joins the next step; a prefill step in flight is in ``Q_w`` already, a decode-only one is the
``+ 1``). A prefill worker (no decode rows) has ``t_w = 0``. (Once the kept R_w has decayed to
what a worker of role both reports while it decodes, that figure already includes its decode
rows' share, and ``t_w`` counts it again: after a long spell of load the estimate errs on the
slow side.)

What the estimate does not see: ``U`` is the whole prompt (the prefix match is the placement's,
after admission), so a prompt whose prefix a worker caches is charged for it; and ``Q_w``
counts a remote prefill on its prefill worker only from the decode worker's Reserve answer on
(pdserve.router.attempt), so requests admitted while Reserves are in flight are not queued
anywhere yet (a local prefill, Submit, counts from its admission on).

Why R_w is a decayed peak (:func:`kept_rate`): a worker's ``prefill_tokens_per_s`` is an
average of its recent prefill steps' throughput, and a small step's throughput is a fraction of
a full one's (fixed costs per step), so after a spell of short prompts it says a tenth of what
the worker does; a queue long enough to matter drains in full steps, at the worker's best rate.
So the gate keeps the highest figure each worker reported (per worker id: a restarted worker
starts afresh), but lets it fall while the worker is busy: every look at the rates (at most
every PEAK_REFRESH_S, as requests arrive) that finds prompt tokens queued on the worker halves
the kept figure per PEAK_HALF_LIFE_S elapsed (at most MAX_DECAY_STEP_S counted per look), and
then raises it to the reported one when that is higher. A figure seen once on an idle machine
(or a lucky step) thus gives way, within a few half-lives of load, to what the worker reports
while it drains a queue, i.e. full steps at today's speed; an idle spell does not wear it down
to a small step's figure. An estimate that is too fast admits too much; too slow, it refuses
what the workers could serve.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pdserve.common.grpc_utils.errors import ResourceExhausted
from pdserve.router.pd_policy import DEFAULT_PREFILL_TOKENS_PER_S

if TYPE_CHECKING:
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.settings import RouterSettings
    from pdserve.router.worker_client import WorkerClient
    from pdserve.router.workers import WorkerRegistry

ADMIT = "admitted"
WAITING_REQUESTS, QUEUED_TOKENS, SLO_TTFT = "waiting-requests", "queued-tokens", "slo-ttft"
REASONS = (WAITING_REQUESTS, QUEUED_TOKENS, SLO_TTFT)
PEAK_REFRESH_S = 0.5        # the workers' rates change only with their GetStats (settings.STATS_INTERVAL_S)
PEAK_HALF_LIFE_S = 30.0     # busy time over which a kept rate halves (kept_rate)
MAX_DECAY_STEP_S = 1.0      # at most this much busy time counted per look at the rates
MAX_RETRY_AFTER_S = 30      # a client told to come back later than this would rather go elsewhere
MIN_QUEUE_SHARE = 0.25      # share of k x the objective a request may always wait in the queue
DEFAULT_SLO_MULTIPLE = 1.0


@dataclass(frozen=True)
class AdmissionConfig:
    """The bounds, each 0 = off (the TTFT objective is the placement's, ``PdConfig.slo_ttft_ms``)."""
    max_queued_prompt_tokens: int = 0     # per place
    max_waiting_requests: int = 0         # per place
    slo_multiple: float = DEFAULT_SLO_MULTIPLE

    def __post_init__(self) -> None:
        for name in ("max_queued_prompt_tokens", "max_waiting_requests", "slo_multiple"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off), not {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return bool(self.max_queued_prompt_tokens or self.max_waiting_requests or self.slo_multiple)


@dataclass(frozen=True, slots=True)
class Place:
    """One place to prefill, as :func:`decide` reads it (module docstring)."""
    queued: int                 # Q: prompt tokens queued there
    rate: float = 0.0           # R: prefill tokens/s (0 = unknown)
    decode_step_ms: float = 0.0 # t: what its decode rows add to each step while it decodes (0: none)
    step_tokens: int = 0        # B: prompt tokens per step (0 = unknown: one step)


@dataclass(frozen=True, slots=True)
class Verdict:
    reason: str                 # ADMIT or one of REASONS
    estimate_ms: float = 0.0    # the rule's estimate at the best place: ttft_w (SLO rule), else T_w(Q_w)
    retry_after_s: int = 0      # refused: the Retry-After to send (0 when admitted)
    detail: str = ""            # refused: what was over which bound

    @property
    def admitted(self) -> bool:
        return self.reason == ADMIT


def prefill_ms(p: Place, tokens: int) -> float:
    """T(n): ms to prefill ``tokens`` prompt tokens at place ``p`` (its rate known), after the
    step in flight."""
    if tokens <= 0:
        return 0.0
    steps = math.ceil(tokens / p.step_tokens) if p.step_tokens > 0 else 1
    return 1000.0 * tokens / p.rate + (steps + 1) * p.decode_step_ms


def decide(places: Sequence[Place], prompt_tokens: int, own_waiting: int, reported_waiting: int,
           cfg: AdmissionConfig, slo_ttft_ms: float) -> Verdict:
    """Admit or refuse one request of ``prompt_tokens`` (U) over its ``places`` (module docstring);
    one pass over the places' queues while some place has nothing queued."""
    n = len(places)
    if n == 0 or not cfg.enabled:
        return Verdict(ADMIT)
    waiting = max(own_waiting, reported_waiting)
    limit = cfg.max_waiting_requests * n
    over_waiting = cfg.max_waiting_requests > 0 and waiting >= limit
    least = min(p.queued for p in places)
    if not over_waiting and least <= 0:
        return Verdict(ADMIT)           # an empty queue: ttft_w = T_w(U) <= bound_w, under any token bound
    places = known_rates(places)
    if over_waiting:
        wait = min(prefill_ms(p, p.queued) for p in places)
        return _refused(WAITING_REQUESTS, wait, wait * (waiting - limit + 1) / waiting,
                        f"{waiting} requests wait for their first token, the bound is {limit} "
                        f"({cfg.max_waiting_requests} per worker x {n})")
    bound = cfg.max_queued_prompt_tokens
    if bound and least >= bound:
        drain = min(prefill_ms(p, p.queued - bound) for p in places)
        return _refused(QUEUED_TOKENS, min(prefill_ms(p, p.queued) for p in places), drain,
                        f"every worker has at least {least} prompt tokens queued, the bound is {bound}")
    if not cfg.slo_multiple:
        return Verdict(ADMIT)
    return _slo_verdict(places, prompt_tokens, cfg.slo_multiple, slo_ttft_ms)


def _slo_verdict(places: Sequence[Place], prompt_tokens: int, k: float, slo_ttft_ms: float) -> Verdict:
    """Rule 4: admitted at the first place where ``ttft_w <= bound_w``, else refused."""
    objective = k * slo_ttft_ms
    best: tuple[float, float, float, int] | None = None     # (ttft - bound, ttft, bound, Q) over the places
    for p in places:
        ttft = prefill_ms(p, p.queued + prompt_tokens)
        bound = max(objective, prefill_ms(p, prompt_tokens) + MIN_QUEUE_SHARE * objective)
        if ttft <= bound:
            return Verdict(ADMIT, ttft)
        if best is None or ttft - bound < best[0]:
            best = (ttft - bound, ttft, bound, p.queued)
    assert best is not None
    over, ttft, bound, queued = best
    return _refused(SLO_TTFT, ttft, over,
                    f"the estimated TTFT is {ttft / 1000:.2f} s on the best of {len(places)} workers "
                    f"({queued} prompt tokens queued there), over its bound of {bound / 1000:.2f} s "
                    f"({k:g} x the TTFT objective of {slo_ttft_ms / 1000:g} s)")


def known_rates(places: Sequence[Place]) -> Sequence[Place]:
    """The places with their rates known: an unknown one's (0) is the mean of the known ones,
    else the default."""
    if min(p.rate for p in places) > 0:
        return places
    known = [p.rate for p in places if p.rate > 0]
    fallback = sum(known) / len(known) if known else DEFAULT_PREFILL_TOKENS_PER_S
    return [p if p.rate > 0 else replace(p, rate=fallback) for p in places]


def kept_rate(kept: float, reported: float, busy: bool, elapsed_s: float) -> float:
    """A worker's R after one look at its rates (module docstring): ``kept`` halved per
    PEAK_HALF_LIFE_S of ``elapsed_s`` (capped at MAX_DECAY_STEP_S) when the worker is ``busy``
    (prompt tokens queued there), then the ``reported`` figure when that is higher."""
    if busy and kept > 0.0:
        kept *= 0.5 ** (min(elapsed_s, MAX_DECAY_STEP_S) / PEAK_HALF_LIFE_S)
    return max(kept, reported)


def retry_after_s(drain_ms: float) -> int:
    """Whole seconds to send as Retry-After for an estimated drain time, 1..MAX_RETRY_AFTER_S."""
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(drain_ms / 1000.0)))


def _refused(reason: str, estimate_ms: float, drain_ms: float, detail: str) -> Verdict:
    return Verdict(reason, estimate_ms, retry_after_s(drain_ms), detail)


class Overloaded(ResourceExhausted):
    """A request refused by admission control: RESOURCE_EXHAUSTED, with the seconds after which
    to try again (``retry_after_s``: on gRPC the ``retry-after`` and ``grpc-retry-pushback-ms``
    trailing metadata, on HTTP the ``Retry-After`` header)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(f"the router is overloaded ({verdict.reason}): {verdict.detail}; "
                         f"retry after {verdict.retry_after_s} s")
        self.reason = verdict.reason
        self.retry_after_s = verdict.retry_after_s


class Waiting:
    """One admitted request until its first token (``close``, idempotent)."""

    __slots__ = ("gate",)

    def __init__(self, gate: AdmissionGate | None) -> None:
        self.gate = gate

    def close(self) -> None:
        if self.gate is not None:
            self.gate.waiting -= 1
            self.gate = None


class AdmissionGate:
    """The router's admission control: :func:`decide` over the registry's workers as they are,
    each one's kept prefill rate (:func:`kept_rate`), and the count of this router's requests
    waiting for their first token."""

    def __init__(self, registry: WorkerRegistry, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.registry = registry
        self.cfg = settings.admission
        self.slo_ttft_ms = settings.pd.slo_ttft_ms
        self.never_remote = settings.pd.mode == "never"
        self.metrics = metrics
        self.waiting = 0
        self._rates: dict[str, float] = {}      # worker id -> R (kept_rate)
        self._rates_at = 0.0                    # time.monotonic() of the last look at the workers' rates

    def admit(self, method: str, prompt_tokens: int = 0, slo_ttft_ms: float = 0.0) -> Waiting:
        """A :class:`Waiting` to close at the request's first token; :class:`Overloaded` (counted
        in the router's metrics) when a bound is exceeded. ``prompt_tokens``: the request's (U;
        0 = not counted); ``slo_ttft_ms``: its own TTFT objective (0 = the router's; the smaller
        of the two counts)."""
        if not self.cfg.enabled:
            return Waiting(None)
        self._look_at_rates()
        places = self._places()
        queued = [c.queued_prompt_tokens for c in places]
        if queued and min(queued) <= 0 and not self.cfg.max_waiting_requests:
            self.waiting += 1                   # decide's first exit, without a snapshot per place
            return Waiting(self)
        slo = min(self.slo_ttft_ms, slo_ttft_ms) if slo_ttft_ms > 0 else self.slo_ttft_ms
        verdict = decide([self._place(c, q) for c, q in zip(places, queued)], prompt_tokens, self.waiting,
                         self._reported_waiting(places), self.cfg, slo)
        if not verdict.admitted:
            self.metrics.refused(method, verdict.reason)
            raise Overloaded(verdict)
        self.waiting += 1
        return Waiting(self)

    def _look_at_rates(self) -> None:
        """Every worker's R after a look at its reported rate (at most every PEAK_REFRESH_S: the
        figures change only with each GetStats)."""
        now = time.monotonic()
        elapsed = now - self._rates_at
        if elapsed < PEAK_REFRESH_S:
            return
        self._rates_at = now
        old = self._rates       # by worker id: a restarted worker (a new id) starts afresh
        self._rates = {c.worker_id: kept_rate(old.get(c.worker_id, 0.0), c.prefill_tokens_per_s,
                                              c.queued_prompt_tokens > 0, elapsed)
                       for c in self.registry.clients.values() if c.worker_id}

    def _place(self, c: WorkerClient, queued: int) -> Place:
        """``c`` as a place (module docstring: t_w counts while it has requests running)."""
        rate = self._rates.get(c.worker_id, 0.0)
        s = c.stats
        if s is None:
            return Place(queued, rate)
        decoding = c.decoding > 0 or s.num_running > 0
        return Place(queued, rate, s.decode_step_ms if decoding else 0.0, s.max_num_batched_tokens)

    def _reported_waiting(self, places: list[WorkerClient]) -> int:
        """The places' engine queues (last GetStats), read only when the bound needs them."""
        per_place = self.cfg.max_waiting_requests
        if not per_place or self.waiting >= per_place * len(places):
            return 0
        return sum([c.stats.num_waiting for c in places if c.stats is not None])

    def _places(self) -> list[WorkerClient]:
        """Where the request could be prefilled (module docstring)."""
        if self.never_remote:
            return self.registry.decode_workers()
        return self.registry.prefill_workers() or self.registry.decode_workers()
