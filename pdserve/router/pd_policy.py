"""Where a request is prefilled: on its decode worker (``local``) or on another worker (``remote``).

Pure functions over snapshots (:func:`decide`) or over the workers' kept figures and the prefix
match (:func:`decide_workers`, the router's path; the same decision), run once per request after
:func:`pdserve.router.policy.pick_decode_workers` chose the decode worker ``D``. ``local`` = Submit
to ``D`` (it prefills and decodes, no transfer); ``remote`` = Reserve on ``D`` + Prefill on a
prefill-capable worker ``P`` (role prefill or both, never ``D`` itself), whose KV is shipped into
``D``'s reserved blocks.

Estimates (ms; ``U_w`` = the request's prompt tokens worker ``w`` must compute, i.e. minus
the prefix it holds by the prefix index; ``Q_w`` = prompt tokens queued on ``w`` before it;
``R_w`` = measured prefill throughput, tokens/s)::

    ttft(local)    = 1000 * (Q_D + U_D) / R_D
    ttft(remote P) = 1000 * (Q_P + U_P) / R_P + remote_overhead_ms + U_D * transfer_us_per_token / 1000

    tpot(option)   = t_dec / (1 - u),  u = lam * c / 1000   (u capped at MAX_UTILISATION)
    lam(remote)    = lam_D                                   (D's decode rows only)
    lam(local)     = lam_D + U_D / rate_window_s             (this prompt joins D's prefill load)
    c              = (t_mix - t_dec) / B   with chunked prefill (extra step ms per prompt token:
                     P tokens under a budget B are ceil(P/B) mixed steps of t_mix instead of t_dec)
                   = 1000 / R_D            without (a whole prefill stalls every decode row)

``t_dec`` / ``t_mix``: ``D``'s measured decode-only and mixed step times; ``B``: its token budget
(``max_num_batched_tokens``); ``lam_D``: prompt tokens per second ``D`` has been computing lately
(what this router sent it to prefill: its Submits and, for a ``both`` worker, the Prefills it
ran for others; an exponentially decayed rate over ``rate_window_s``). ``u`` is the share of
``D``'s time spent on prompt chunks; every decode row waits for it, so the time per output
token of ``D``'s requests is ``t_dec / (1 - u)``.

Which remote candidate: the lowest ``rank(P) = ttft(remote P) + 1000 * alpha * max(0, W_P - mean W) / R_P``
(``W_P``: prompt tokens this router gave ``P`` to compute lately, a counter decayed over
``rate_window_s``; the mean over the remote candidates; ``alpha``: the router's ``--load-alpha``).
A worker that computed more than its share lately is where the conversations it prefilled
will come back (a conversation's next turn is cheapest where its history is cached), so a
request whose prefix would save little there, such as a new conversation that shares only a
system prompt, starts its history on a worker with less of that coming: without this term
every conversation of a system prompt piles onto the worker that computed the prompt first,
and their later turns queue there while other prefill workers idle (multi-turn simulation,
docs/benchmarks.md). A next turn whose history a worker holds still goes there while the
history saves more than that worker's excess. The decision keeps the chosen worker's
``ttft`` estimate (the rank is not a time).

Each option's headroom is ``h = min(1 - ttft / slo_ttft_ms, 1 - tpot / slo_tpot_ms)`` (negative:
an SLO is missed); the option with the most headroom wins (over two SLOs: the one that
violates least). Documented rules for ties and uncertainty, in order:

1. ``never`` -> local; ``always`` -> remote on the candidate with the lowest rank (local when
   there is none).
2. No prefill-capable worker besides ``D`` -> local (``no-prefill-worker``).
3. ``D`` of role decode -> remote (``decode-only``): it prefills only as a fallback.
4. Short prompt: ``U_D <= local_max_tokens`` -> local (``short-prompt``): a chunk that small
   costs ``D`` less than a Reserve + transfer costs the request. Because ``U_D`` counts only
   what ``D`` lacks, a prompt whose prefix ``D`` caches stays there (cache affinity).
5. Otherwise the most headroom (``slo-headroom``); local keeps a tie within ``TIE_MARGIN``
   (no transfer, no second worker busy); among remote candidates ties go to the lower rank,
   then the lower key.

Unmeasured figures (0 in GetStats until the worker ran such a step): a throughput is the
mean of the candidates' measured ones, else DEFAULT_PREFILL_TOKENS_PER_S; ``t_dec`` is
DEFAULT_DECODE_STEP_MS; ``t_mix`` is ``t_dec + 1000 * B / R_D`` (B prompt tokens at D's rate).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

PD_MODES = ("adaptive", "always", "never")   # this module's modes; every policy: router/placement_policies.py
LOCAL, REMOTE = "local", "remote"
DEFAULT_PREFILL_TOKENS_PER_S = 8000.0   # unmeasured and no measured peer: a mid-size model on one GPU
DEFAULT_DECODE_STEP_MS = 10.0           # unmeasured decode step
MAX_UTILISATION = 0.95                  # u above this: D cannot keep up; tpot = t_dec / 0.05
TIE_MARGIN = 0.02                       # headrooms closer than this are a tie (local keeps it)


@dataclass(frozen=True)
class PdConfig:
    mode: str = "fleet"                # the router's default policy (docs/design.md, Decisions)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 50.0
    local_max_tokens: int = 256        # rule 4
    remote_overhead_ms: float = 2.0    # Reserve round trip + PushKV + the transfer's start
    transfer_us_per_token: float = 1.0 # KV bytes per token / link bandwidth (~150 KB at ~150 GB/s)
    rate_window_s: float = 2.0         # time constant of lam_D (pdserve.router.worker_client)
    move_interval_s: float = 1.0       # fleet: period of the decode moves (fleet_policy.pick_moves); 0 = off

    def __post_init__(self) -> None:
        if not self.mode:
            raise ValueError("pd policy must name a placement policy (pdserve/router/placement_policies.py)")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "rate_window_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and > 0, not {getattr(self, name)}")
        for name in ("local_max_tokens", "remote_overhead_ms", "transfer_us_per_token", "move_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")


@dataclass(slots=True)
class PrefillPlace:
    """A worker as a place to prefill this request (the router makes one, for ``D``; the
    candidates ``decide_workers`` reads are the workers themselves)."""
    key: str
    uncached_tokens: int          # U: prompt tokens it must compute (prompt minus its cached prefix)
    queued_tokens: int = 0        # Q: prompt tokens queued there before this one
    tokens_per_s: float = 0.0     # R: measured prefill throughput; 0 = unmeasured
    recent_tokens: float = 0.0    # W: prompt tokens it was given lately (decayed over rate_window_s)


class PrefillWorker(Protocol):
    """A worker as a place to prefill, as ``decide_workers`` reads it (``WorkerClient`` keeps
    these current); its U comes from the prefix match."""

    @property
    def key(self) -> str: ...
    @property
    def queued_prompt_tokens(self) -> int: ...      # Q
    @property
    def prefill_tokens_per_s(self) -> float: ...    # R; 0 = unmeasured
    @property
    def prefill_counter(self) -> float: ...         # W's decayed counter when last updated ...
    @property
    def prefill_counter_at(self) -> float: ...      # ... and when (W = counter * exp(-(now - at) / rate_window_s))


@dataclass(frozen=True)
class DecodePlace:
    """The chosen decode worker D: a place to prefill (local) and to decode."""
    place: PrefillPlace
    can_prefill: bool = True      # role both (role decode prefills only as a fallback)
    decode_step_ms: float = 0.0   # t_dec; 0 = unmeasured
    mixed_step_ms: float = 0.0    # t_mix; 0 = unmeasured
    max_num_batched_tokens: int = 0   # B
    chunked_prefill: bool = True
    prefill_rate: float = 0.0     # lam_D: prompt tokens/s it has been computing lately


@dataclass(frozen=True)
class PdDecision:
    kind: str                     # local | remote
    prefill_key: str | None       # the remote prefill worker (None: local)
    reason: str                   # which rule decided (see the module docstring)
    ttft_ms: float                # estimates of the chosen option
    tpot_ms: float
    prefill_tokens: int = 0       # prompt tokens the chosen place computes (U)


def _rate(r: float, fallback: float) -> float:
    return r if r > 0 else fallback


def fallback_rate(places: Sequence[PrefillPlace]) -> float:
    return _mean_measured([p.tokens_per_s for p in places])


def _mean_measured(rates: list[float]) -> float:
    measured = [r for r in rates if r > 0]
    return sum(measured) / len(measured) if measured else DEFAULT_PREFILL_TOKENS_PER_S


def ttft_local_ms(d: DecodePlace, fallback: float) -> float:
    p = d.place
    return 1000.0 * (p.queued_tokens + p.uncached_tokens) / _rate(p.tokens_per_s, fallback)


def ttft_remote_ms(p: PrefillPlace, d: DecodePlace, cfg: PdConfig, fallback: float) -> float:
    compute = 1000.0 * (p.queued_tokens + p.uncached_tokens) / _rate(p.tokens_per_s, fallback)
    return compute + cfg.remote_overhead_ms + d.place.uncached_tokens * cfg.transfer_us_per_token / 1000.0


def ms_per_prompt_token(d: DecodePlace, fallback: float) -> float:
    """c: the step time D's decode rows lose per prompt token D computes."""
    r = _rate(d.place.tokens_per_s, fallback)
    if not d.chunked_prefill or d.max_num_batched_tokens <= 0:
        return 1000.0 / r
    t_dec = d.decode_step_ms or DEFAULT_DECODE_STEP_MS
    b = d.max_num_batched_tokens
    t_mix = d.mixed_step_ms if d.mixed_step_ms > 0 else t_dec + 1000.0 * b / r
    return max(t_mix - t_dec, 0.0) / b


def tpot_ms(d: DecodePlace, extra_tokens: int, cfg: PdConfig, fallback: float) -> float:
    """t_dec / (1 - u) with ``extra_tokens`` more prompt tokens for D (0: remote)."""
    lam = d.prefill_rate + extra_tokens / cfg.rate_window_s
    u = min(lam * ms_per_prompt_token(d, fallback) / 1000.0, MAX_UTILISATION)
    return (d.decode_step_ms or DEFAULT_DECODE_STEP_MS) / (1.0 - u)


def headroom(ttft: float, tpot: float, cfg: PdConfig) -> float:
    return min(1.0 - ttft / cfg.slo_ttft_ms, 1.0 - tpot / cfg.slo_tpot_ms)


def fastest_remote(d: DecodePlace, cands: Sequence[PrefillPlace], cfg: PdConfig,
                   fallback: float, alpha: float = 1.0) -> tuple[float, str, int]:
    """(ttft, key, uncached tokens) of the remote candidate with the lowest rank, then the lower
    key (the module docstring's rank: ttft plus the excess of recent work; every remote option
    has the same tpot, so among equal excesses the lowest ttft is also the most headroom)."""
    mean = sum(p.recent_tokens for p in cands) / len(cands)

    def ranked(i: int) -> tuple[float, str, float]:      # (rank, key, ttft)
        p = cands[i]
        r = p.tokens_per_s if p.tokens_per_s > 0 else fallback
        ttft = 1000.0 * (p.queued_tokens + p.uncached_tokens) / r
        excess = p.recent_tokens - mean
        return (ttft + 1000.0 * alpha * excess / r if alpha > 0 and excess > 0 else ttft, p.key, ttft)

    _, _, ttft, i = min((*ranked(i), i) for i in range(len(cands)))
    extra = cfg.remote_overhead_ms + d.place.uncached_tokens * cfg.transfer_us_per_token / 1000.0
    return ttft + extra, cands[i].key, cands[i].uncached_tokens


def decide(d: DecodePlace, candidates: Sequence[PrefillPlace], cfg: PdConfig, alpha: float = 1.0) -> PdDecision:
    """Local or remote (and where) for one request; see the module docstring."""
    own = d.place.key
    cands = [p for p in candidates if p.key != own]
    fallback = fallback_rate([d.place, *cands])
    return _rules(d, cfg, fallback, (lambda: fastest_remote(d, cands, cfg, fallback, alpha)) if cands else None)


def decide_workers(d: DecodePlace, workers: Sequence[PrefillWorker], matched: Mapping[str, int],
                   prompt_tokens: int, block_size: int, cfg: PdConfig, alpha: float = 1.0,
                   now: float = 0.0) -> PdDecision:
    """``decide`` over workers as they are: ``matched`` (worker key -> leading blocks of the prompt
    it holds, absent: none) gives each its U, their decayed counters seen at ``now`` (the clock of
    ``prefill_counter_at``) their W; no object is made per worker. The same decision as ``decide``
    on their PrefillPlaces."""
    own = d.place.key
    ws = [w for w in workers if w.key != own]
    fallback = _mean_measured([d.place.tokens_per_s, *(w.prefill_tokens_per_s for w in ws)])
    if not ws:
        return _rules(d, cfg, fallback, None)

    def fastest() -> tuple[float, str, int]:      # fastest_remote over the workers
        get = matched.get
        tau = cfg.rate_window_s         # decayed_rate inlined (W of an idle worker: 0)
        recent = [w.prefill_counter * math.exp(-(now - w.prefill_counter_at) / tau) if w.prefill_counter else 0.0
                  for w in ws] if alpha > 0 else None
        mean = sum(recent) / len(recent) if recent else 0.0
        best, ttft, key = math.inf, math.inf, ""
        for i, w in enumerate(ws):      # uncached_tokens inlined: one pass, no object per worker
            cached = get(w.key, 0) * block_size
            u = prompt_tokens - cached if cached < prompt_tokens else min(prompt_tokens, 1)
            r = w.prefill_tokens_per_s
            r = r if r > 0 else fallback
            t = 1000.0 * (w.queued_prompt_tokens + u) / r
            rank = t + 1000.0 * alpha * (recent[i] - mean) / r if recent and recent[i] > mean else t
            if rank < best or (rank == best and w.key < key):
                best, ttft, key = rank, t, w.key
        extra = cfg.remote_overhead_ms + d.place.uncached_tokens * cfg.transfer_us_per_token / 1000.0
        return ttft + extra, key, uncached_tokens(prompt_tokens, get(key, 0), block_size)

    return _rules(d, cfg, fallback, fastest)


def _rules(d: DecodePlace, cfg: PdConfig, fallback: float,
           fastest: Callable[[], tuple[float, str, int]] | None) -> PdDecision:
    """The rules of the module docstring; ``fastest``: (ttft, key, U) of the fastest remote
    candidate, None when there is none."""
    def local(reason: str) -> PdDecision:
        return PdDecision(LOCAL, None, reason, ttft_local_ms(d, fallback),
                          tpot_ms(d, d.place.uncached_tokens, cfg, fallback), d.place.uncached_tokens)

    if cfg.mode == "never":
        return local("never")
    if fastest is None:
        return local("no-prefill-worker")
    if cfg.mode != "always" and d.can_prefill and d.place.uncached_tokens <= cfg.local_max_tokens:
        return local("short-prompt")
    ttft, key, uncached = fastest()
    s_rem = tpot_ms(d, 0, cfg, fallback)
    if cfg.mode == "always":
        return PdDecision(REMOTE, key, "always", ttft, s_rem, uncached)
    if not d.can_prefill:
        return PdDecision(REMOTE, key, "decode-only", ttft, s_rem, uncached)
    t_loc, s_loc = ttft_local_ms(d, fallback), tpot_ms(d, d.place.uncached_tokens, cfg, fallback)
    if headroom(ttft, s_rem, cfg) > headroom(t_loc, s_loc, cfg) + TIE_MARGIN:
        return PdDecision(REMOTE, key, "slo-headroom", ttft, s_rem, uncached)
    return local("slo-headroom")


def uncached_tokens(prompt_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Prompt tokens a worker holding ``matched_blocks`` leading blocks must compute (the last
    prompt token is always computed: a prefix hit never covers it)."""
    cached = matched_blocks * block_size
    if cached >= prompt_tokens:
        return 1 if prompt_tokens > 0 else prompt_tokens
    return prompt_tokens - cached if cached > 0 else prompt_tokens


def decayed_rate(value: float, last_s: float, now_s: float, window_s: float) -> float:
    """An exponentially decayed token counter (``value`` at ``last_s``) as seen at ``now_s``;
    ``counter / window_s`` is the recent rate (see DecodePlace.prefill_rate)."""
    if now_s <= last_s:
        return value
    return value * math.exp(-(now_s - last_s) / window_s)
