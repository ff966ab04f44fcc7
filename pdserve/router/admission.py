"""Admission control: whether the router takes a new request now or refuses it at once.

Under a burst far above what the workers can prefill, queueing every request makes every TTFT
grow without bound; a request refused at once (gRPC RESOURCE_EXHAUSTED, HTTP 429 with
``Retry-After``) can go to another replica or come back later, and those admitted keep their
TTFT. The check runs where a request starts (``Flow.generate``, the one path of every front
door), before placement, so a refused request costs no worker rpc and reserves no KV.

:func:`decide` is a pure function over snapshots of the places that could prefill the request
(the usable prefill-capable workers, roles prefill and both; the decode workers instead under
``--pd-policy never`` or when no prefill-capable worker is up), given as parallel lists. Per
place ``w``::

    Q_w     prompt tokens queued on w: this router's, live, plus the other replicas' (last GetStats)
    R_w     w's prefill rate, tokens/s: the highest it has reported to this router (below; the
            gate looks at most every PEAK_REFRESH_S, as requests arrive); unknown (0): the mean
            of the known ones, else pd_policy.DEFAULT_PREFILL_TOKENS_PER_S
    wait_w  = 1000 * Q_w / R_w     (ms: the queueing part of a TTFT there)

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
4. [slo-ttft] ``slo_multiple > 0`` and ``min_w wait_w > slo_multiple * slo_ttft_ms``: even the
   best place would make the request wait more than that multiple of the TTFT objective.

Only queued work counts, never the request's own prompt: a refusal must be something waiting
fixes (a long prompt on an idle fleet is always admitted; its own prefill time is not a queue).
Every place must be over a bound for a refusal, so a request that some worker could still take
within the bounds is admitted (placement may still choose a busier worker for its cache).

``Retry-After`` (whole seconds, ``ceil`` of the estimate, clamped to 1..MAX_RETRY_AFTER_S): when
the best place's queue will have drained below the bound at its rate::

    waiting-requests   min_w wait_w * (W - L + 1) / W          (L = max_waiting_requests * N: the
                                                                excess share of the queue)
    queued-tokens      min_w 1000 * (Q_w - max_queued_prompt_tokens) / R_w
    slo-ttft           min_w wait_w - slo_multiple * slo_ttft_ms

Why the highest reported rate: a worker's ``prefill_tokens_per_s`` is an average of its recent
prefill steps' throughput, and a small step's throughput is a fraction of a full one's (fixed
costs per step), so after a spell of short prompts it says a tenth of what the worker does. A
queue long enough to matter drains in full steps, at the worker's best rate; the highest figure
seen is that rate (kept per worker id: a restarted worker starts afresh). An estimate that is too
fast admits too much, one too slow would refuse what the workers could serve: the SLO bound
refuses only when even the optimistic estimate is over.

Why a multiple of the SLO, 2 by default: the estimate is noisy (the other replicas' queues are
up to one stats poll old, a role-both worker prefills slower while it decodes, a burst may
drain faster than its rate says), so refusing at the SLO itself would refuse requests that
would have met it; at twice the objective a request that waits that long has missed it
whatever happens next.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from operator import truediv
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
MAX_RETRY_AFTER_S = 30      # a client told to come back later than this would rather go elsewhere
DEFAULT_SLO_MULTIPLE = 2.0


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
class Verdict:
    reason: str                 # ADMIT or one of REASONS
    wait_ms: float = 0.0        # min_w wait_w
    retry_after_s: int = 0      # refused: the Retry-After to send (0 when admitted)
    detail: str = ""            # refused: what was over which bound

    @property
    def admitted(self) -> bool:
        return self.reason == ADMIT


def decide(queued: Sequence[int], rates: Sequence[float], own_waiting: int, reported_waiting: int,
           cfg: AdmissionConfig, slo_ttft_ms: float) -> Verdict:
    """Admit or refuse one request (module docstring) over the places' ``queued`` prompt tokens
    (Q) and prefill ``rates`` (R, 0 = unknown), in the same order; a few C-level passes, and only
    one while a place has nothing queued."""
    n = len(queued)
    if n == 0 or not cfg.enabled:
        return Verdict(ADMIT)
    waiting = max(own_waiting, reported_waiting)
    limit = cfg.max_waiting_requests * n
    over_waiting = cfg.max_waiting_requests > 0 and waiting >= limit
    least = min(queued)
    if not over_waiting and least <= 0:
        return Verdict(ADMIT)           # an empty queue: no wait, under any token bound
    rates = known_rates(rates)
    wait = 1000.0 * min(map(truediv, queued, rates))
    if over_waiting:
        return _refused(WAITING_REQUESTS, wait, wait * (waiting - limit + 1) / waiting,
                        f"{waiting} requests wait for their first token, the bound is {limit} "
                        f"({cfg.max_waiting_requests} per worker x {n})")
    bound = cfg.max_queued_prompt_tokens
    if bound and least >= bound:
        drain = 1000.0 * min((q - bound) / r for q, r in zip(queued, rates))
        return _refused(QUEUED_TOKENS, wait, drain,
                        f"every worker has at least {least} prompt tokens queued, the bound is {bound}")
    slo = cfg.slo_multiple * slo_ttft_ms
    if cfg.slo_multiple and wait > slo:
        return _refused(SLO_TTFT, wait, wait - slo,
                        f"the estimated queue wait is {wait / 1000:.1f} s on the least busy of {n} workers, "
                        f"over {cfg.slo_multiple:g} x the TTFT objective of {slo_ttft_ms / 1000:g} s")
    return Verdict(ADMIT, wait)


def known_rates(rates: Sequence[float]) -> Sequence[float]:
    """R of every place: an unknown one's (0) is the mean of the known ones, else the default."""
    if min(rates) > 0:
        return rates
    known = [r for r in rates if r > 0]
    fallback = sum(known) / len(known) if known else DEFAULT_PREFILL_TOKENS_PER_S
    return [r if r > 0 else fallback for r in rates]


def retry_after_s(drain_ms: float) -> int:
    """Whole seconds to send as Retry-After for an estimated drain time, 1..MAX_RETRY_AFTER_S."""
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(drain_ms / 1000.0)))


def _refused(reason: str, wait_ms: float, drain_ms: float, detail: str) -> Verdict:
    return Verdict(reason, wait_ms, retry_after_s(drain_ms), detail)


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
    the highest prefill rate each has reported (module docstring), and the count of this
    router's requests waiting for their first token."""

    def __init__(self, registry: WorkerRegistry, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.registry = registry
        self.cfg = settings.admission
        self.slo_ttft_ms = settings.pd.slo_ttft_ms
        self.never_remote = settings.pd.mode == "never"
        self.metrics = metrics
        self.waiting = 0
        self._peaks: dict[str, float] = {}      # worker id -> the highest prefill_tokens_per_s seen
        self._peaks_due = 0.0                   # time.monotonic() of the next look at the workers' rates

    def admit(self, method: str) -> Waiting:
        """A :class:`Waiting` to close at the request's first token; :class:`Overloaded` (counted
        in the router's metrics) when a bound is exceeded."""
        if not self.cfg.enabled:
            return Waiting(None)
        places = self._places()
        queued = [c.queued_prompt_tokens for c in places]
        verdict = decide(queued, self._rates(places, queued), self.waiting, self._reported_waiting(places),
                         self.cfg, self.slo_ttft_ms)
        if not verdict.admitted:
            self.metrics.refused(method, verdict.reason)
            raise Overloaded(verdict)
        self.waiting += 1
        return Waiting(self)

    def _rates(self, places: list[WorkerClient], queued: list[int]) -> list[float]:
        """Each place's highest reported prefill rate (0: none yet); not read (all 0) while a
        place has nothing queued, when decide needs no rate."""
        now = time.monotonic()
        if now >= self._peaks_due:          # the figures change only with each GetStats
            self._peaks_due = now + PEAK_REFRESH_S
            old = self._peaks     # by worker id: a restarted worker (a new id) starts afresh
            self._peaks = {c.worker_id: max(old.get(c.worker_id, 0.0), c.prefill_tokens_per_s)
                           for c in self.registry.clients.values() if c.worker_id}
        if not queued or min(queued) <= 0:
            return [0.0] * len(places)
        peaks = self._peaks
        return [peaks.get(c.worker_id, 0.0) for c in places]

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
