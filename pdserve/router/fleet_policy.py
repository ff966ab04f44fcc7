"""Placement over a fleet of workers that all serve both phases (``--pd-policy fleet``): per request,
the worker that decodes it (``D``) and the worker that prefills it (``P``), chosen from all
decode-capable workers. ``P == D`` is a local prefill (Submit); otherwise the router reserves on
``D`` and ships the KV from ``P``.

Two regimes, chosen per request from the whole fleet's figures:
- **Co-location** (the usual case): the request goes where co-location would send it (``home``:
  the decode pick of pdserve.router.policy, cached prefix and load) and is prefilled there, unless
  that breaks its TTFT objective; under the loads where co-location keeps every SLO the fleet *is*
  co-location.
- **A lean worker** while co-location's own TPOT is at risk from the prompts: the worker with the
  fewest decode rows is kept free of new decode rows and prefills for the others, as a static 1P1D
  split does, while co-location's TPOT estimate (``tpot_co``) is over DEDICATE_AT of the objective
  and another worker's decode rows keep the objective without it. It begins only where the rows
  alone keep under DEDICATE_CAUSE of it (``t_co``; when the rows break it, concentrating them
  cannot help); once dedicated (no rows of its own, the others' steps longer with its rows) it
  stays while the prompts take at least the share of each GPU's time that those two bounds imply. Once no
  other worker keeps the objective, every GPU's decode bandwidth is needed and the rows balance
  again (co-location). That test is against the objective itself, not the guard's goal that the
  other choices use: beside a dedicated lean a worker computes no prompts, and the margin made a
  busy lean flap in and out as the others' steps moved around it. Also, where the GPUs have decode
  bandwidth to spare (their rows' steps under ROOMY_SHARE of the objective, or the lean already
  free of rows), a lean busy prefilling (given LEAN_BUSY_SHARE of its prefill-sized rate lately)
  is dedicated before co-location is at risk: prompts in prefill-sized steps on one GPU cost less
  than the same prompts in every GPU's mixed steps (the decode step far under the objective, as
  on an H200 with this project's 8B geometry).

A worker may run the TPOT guard (pdserve/common/engine/tpot_guard.py) or not (a chunk of its step
budget every step, as co-location runs); the router models either. Pure functions over snapshots
(:class:`FleetWorker`); the formulas, per worker ``w`` (ms; ``U_w`` the request's prompt tokens
``w`` lacks, ``Q_w`` prompt tokens queued there, ``R_w`` its measured prefill rate in tokens/s,
``rows_w`` its decode rows, ``t_w`` its decode step, ``c_w`` the extra ms per prompt token of its
mixed steps, ``W_w`` the prompt tokens this router gave it lately, ``B_w`` its step budget)::

    goal        = slo_tpot * (1 - GUARD_MARGIN)
    room_w      = rows_w == 0 or t_w <= goal       (its decode rows alone keep the TPOT objective)
    full_w      = max(R_w, 1000 / c_w)             (what w computes in a step without decode rows)
    t_co        = the mean t_w of the decode-capable workers with rows
    tpot_co     = t_co / (1 - P * c / 1000), P = sum(W_w) / window / n (each of the n decode-capable
                  workers' share of the recent prompt tokens), c = the mean measured c_w
                  (co-location's TPOT: a step stretched by its share of mixed-step prompt time)
    lean        = the decode-capable worker with the fewest rows (then the largest W), *dedicated*
                  while another decode-capable worker keeps the objective itself (rows 0 or t <=
                  slo_tpot: a worker beside a dedicated lean prefills nothing, so its decode step
                  is its TPOT; two or more only) and either
                  - at risk: tpot_co > DEDICATE_AT * slo_tpot and the prompts are the cause:
                    t_co <= DEDICATE_CAUSE * slo_tpot, or rows_lean == 0 and
                    1 - t_co / tpot_co >= 1 - DEDICATE_CAUSE / DEDICATE_AT, or
                  - busy with headroom: W_lean / window >= LEAN_BUSY_SHARE * full_lean and
                    (rows_lean == 0 or t_co <= ROOMY_SHARE * slo_tpot)
    D           = among the decode-capable workers but a dedicated lean:
                  home                              if room_home (or nobody has room)
                = the fewest rows among those with room, fewer U breaking ties; none: the fewest rows
    rate_w      = full_w                           if rows_w == 0
                = min(R_w, 1000 * k / (t_w + c_w * k)), k = max(B_w - rows_w, MIN_CHUNK_TOKENS)
                                                   a worker without the guard with rows and B_w known
                = min(R_w, 1000 * (goal - t_w) / (c_w * goal))   otherwise with rows (guarded): the
                  slack of each step, on average; where the slack holds fewer than MIN_CHUNK_TOKENS,
                  the guard's floor: min(R_w, 1000 * MIN_CHUNK_TOKENS / (t_w + c_w * MIN_CHUNK_TOKENS))
    ttft_w      = 1000 * (Q_w + U_w) / rate_w  (+ remote_overhead_ms + U_D * transfer_us / 1000 if w != D)
    cost_w      = ttft_w + rows_w * U_w * c_w     (this request's wait + each decode row's wait)
    candidates  = the workers that can prefill (a role-decode D only where none can)
    keeps       = every candidate                 while a lean is dedicated (a long queue on the lean
                                                  still costs less than stalling the others' decode rows)
                = the workers with ttft_w <= TTFT_SHARE * slo_ttft   otherwise
    P           = D                                 if no lean is dedicated, D keeps, and D is not role decode
                = the lowest cost among keeps     otherwise (a dedicated lean: no decode rows wait on it);
                  none: the lowest ttft (ties: the key)

Moving decodes (:func:`pick_moves`, run every ``--pd-move-interval-s``), the most loaded sources
first: a worker whose decode rows alone break the objective itself (``t_w > slo_tpot``: a move
stalls its stream for a few hundred ms, which only rows already over the objective gain back)
moves ``min((rows_src - rows_dst) // 2, MAX_MOVES_PER_ROUND)`` of them to ``dst``, the worker
with the fewest rows among the decode-capable ones with room that hold at least two rows fewer,
are not the dedicated lean and are not yet in a move this round (each worker in one move a round).
A moved decode is continued on ``dst`` from its prompt and
the tokens already sent, prefilled on ``src`` (whose prefix cache holds all of its full blocks) and
its KV shipped like any remote prefill.

Unmeasured figures: ``R`` is the mean of the measured ones, else DEFAULT_PREFILL_TOKENS_PER_S;
``t`` is DEFAULT_DECODE_STEP_MS; ``c`` is ``1000 / R``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.worker_types import MIN_CHUNK_TOKENS
from pdserve.router.pd_policy import DEFAULT_DECODE_STEP_MS, LOCAL, REMOTE, PdConfig, PdDecision, _mean_measured

TTFT_SHARE = 0.6    # a prefill place keeps the TTFT SLO while its estimate is under this share of it
GUARD_MARGIN = 0.05  # the workers' default --tpot-margin (the budget the router expects of them)
MAX_MOVES_PER_ROUND = 4   # decodes one worker gives away per round of pick_moves
DEDICATE_AT = 0.9         # a lean is dedicated while co-location's TPOT estimate is over this share of the SLO ...
DEDICATE_CAUSE = 0.85     # ... and, to begin, the decode rows alone keep under this share (the prompts are the cause)
LEAN_BUSY_SHARE = 0.25    # or while given this share of its prefill rate ...
ROOMY_SHARE = 0.7         # ... where, to begin, the decode rows take under this share of the objective


@dataclass(frozen=True, slots=True)
class FleetWorker:
    """One worker as the fleet policy sees it (module docstring's symbols)."""
    key: str
    uncached_tokens: int            # U
    queued_tokens: int = 0          # Q
    tokens_per_s: float = 0.0       # R; 0 = unmeasured
    decode_rows: int = 0            # rows
    decode_step_ms: float = 0.0     # t; 0 = unmeasured
    ms_per_prompt_token: float = 0.0  # c; 0 = unmeasured
    max_num_batched_tokens: int = 0   # B; 0 = unknown
    recent_tokens: float = 0.0      # W
    can_decode: bool = True         # role both or decode (a candidate for D)
    can_prefill: bool = True        # role both or prefill (a candidate for P; D may always prefill its own)
    guarded: bool = True            # runs the TPOT guard (its --tpot-target-ms > 0)


def pick_decode(workers: Sequence[FleetWorker], slo_tpot_ms: float, home: str | None = None,
                window_s: float = 2.0) -> FleetWorker:
    """D (module docstring) among the workers that can decode (at least one); ``home`` is
    co-location's pick (None or unknown: no preference, the fewest rows)."""
    lean = dedicated_lean(workers, slo_tpot_ms, window_s)
    decoders = [w for w in workers if w.can_decode and w is not lean]
    own = next((w for w in decoders if w.key == home), None)
    room = [w for w in decoders if has_room(w, slo_tpot_ms)]
    if own is not None and (own in room or not room):
        return own
    return min(room or decoders, key=lambda w: (w.decode_rows, w.uncached_tokens, w.key))


def has_room(w: FleetWorker, slo_tpot_ms: float) -> bool:
    """Whether ``w``'s decode rows alone keep the TPOT objective (the guard's goal)."""
    return w.decode_rows == 0 or _step_ms(w) <= slo_tpot_ms * (1.0 - GUARD_MARGIN)


def dedicated_lean(workers: Sequence[FleetWorker], slo_tpot_ms: float, window_s: float) -> FleetWorker | None:
    """The lean worker, kept free of decode rows, while the prompts put co-location's TPOT at risk
    or keep it busy where the GPUs have decode bandwidth to spare, and another's decode rows keep
    the TPOT objective without it (module docstring); None otherwise (or with fewer than two
    decode-capable workers)."""
    decoders = [w for w in workers if w.can_decode]
    if len(decoders) < 2:
        return None
    lean = min(decoders, key=lambda w: (w.decode_rows, -w.recent_tokens, w.key))
    t_co, tpot_co = colocated_tpot_ms(decoders, window_s)
    at_risk = tpot_co > DEDICATE_AT * slo_tpot_ms
    share = 1.0 - t_co / tpot_co if tpot_co > 0 else 0.0    # of each GPU's time, in prompt tokens
    caused = (t_co <= DEDICATE_CAUSE * slo_tpot_ms
              or (lean.decode_rows == 0 and share >= 1.0 - DEDICATE_CAUSE / DEDICATE_AT))
    keeps = any(w is not lean and (w.decode_rows == 0 or _step_ms(w) <= slo_tpot_ms) for w in decoders)
    full = full_rate(lean, _mean_measured([w.tokens_per_s for w in workers]))
    busy = lean.recent_tokens / window_s >= LEAN_BUSY_SHARE * full
    roomy = lean.decode_rows == 0 or t_co <= ROOMY_SHARE * slo_tpot_ms
    return lean if keeps and ((at_risk and caused) or (busy and roomy)) else None


def colocated_tpot_ms(decoders: Sequence[FleetWorker], window_s: float) -> tuple[float, float]:
    """(t_co, tpot_co): the mean decode step of the workers with rows, and the TPOT co-location
    would give with the fleet's recent prompt tokens spread evenly over ``decoders`` in mixed
    steps (module docstring); (0, 0) without rows, tpot_co inf when the prompts alone fill them."""
    rows = [w for w in decoders if w.decode_rows > 0]
    if not rows:
        return 0.0, 0.0
    t_co = sum(_step_ms(w) for w in rows) / len(rows)
    measured = [w.ms_per_prompt_token for w in decoders if w.ms_per_prompt_token > 0]
    c = (sum(measured) / len(measured) if measured
         else 1000.0 / _mean_measured([w.tokens_per_s for w in decoders]))
    share = sum(w.recent_tokens for w in decoders) / window_s / len(decoders) * c / 1000.0
    return t_co, (t_co / (1.0 - share) if share < 1.0 else float("inf"))


def full_rate(w: FleetWorker, fallback: float) -> float:
    """Prompt tokens per second ``w`` computes in steps without decode rows: its measured rate,
    or 1000 / c_w when that is higher (the rate may come from steps beside decode rows)."""
    r = w.tokens_per_s if w.tokens_per_s > 0 else fallback
    return max(r, 1000.0 / w.ms_per_prompt_token) if w.ms_per_prompt_token > 0 else r


def prefill_rate(w: FleetWorker, slo_tpot_ms: float, fallback: float) -> float:
    """rate_w: prompt tokens per second ``w`` computes for its queue (module docstring)."""
    if w.decode_rows == 0:
        return full_rate(w, fallback)
    r = w.tokens_per_s if w.tokens_per_s > 0 else fallback
    c = w.ms_per_prompt_token if w.ms_per_prompt_token > 0 else 1000.0 / r
    t = _step_ms(w)
    if not w.guarded and w.max_num_batched_tokens > 0:
        k = max(w.max_num_batched_tokens - w.decode_rows, MIN_CHUNK_TOKENS)
        return min(r, 1000.0 * k / (t + c * k))
    goal = slo_tpot_ms * (1.0 - GUARD_MARGIN)
    if goal - t < c * MIN_CHUNK_TOKENS:     # the guard's floor: MIN_CHUNK_TOKENS a step
        return min(r, 1000.0 * MIN_CHUNK_TOKENS / (t + c * MIN_CHUNK_TOKENS))
    return min(r, 1000.0 * (goal - t) / (c * goal))


def decide(workers: Sequence[FleetWorker], cfg: PdConfig, home: str | None = None) -> tuple[str, PdDecision]:
    """(D's key, the decision: local on D, or remote with P's key) for one request; ``workers``
    holds at least one that can decode; ``home``: co-location's pick. Reason ``fleet`` on every
    decision."""
    d = pick_decode(workers, cfg.slo_tpot_ms, home, cfg.rate_window_s)
    lean = dedicated_lean(workers, cfg.slo_tpot_ms, cfg.rate_window_s)
    fallback = _mean_measured([w.tokens_per_s for w in workers])
    transfer = cfg.remote_overhead_ms + d.uncached_tokens * cfg.transfer_us_per_token / 1000.0
    options = []
    places = [w for w in workers if w.can_prefill] or [d]   # a role-decode D prefills only when nobody else can
    for w in places:
        r = w.tokens_per_s if w.tokens_per_s > 0 else fallback
        c = w.ms_per_prompt_token if w.ms_per_prompt_token > 0 else 1000.0 / r
        ttft = 1000.0 * (w.queued_tokens + w.uncached_tokens) / prefill_rate(w, cfg.slo_tpot_ms, fallback)
        ttft += 0.0 if w is d else transfer
        options.append((ttft, ttft + w.decode_rows * w.uncached_tokens * c, w))
    keeps = options if lean is not None else [o for o in options if o[0] <= TTFT_SHARE * cfg.slo_ttft_ms]
    local = next((o for o in keeps if o[2] is d and d.can_prefill), None) if lean is None else None
    if local is not None:
        ttft, p = local[0], d
    else:
        ttft, _, p = (min(keeps, key=lambda o: (o[1], o[2].key)) if keeps
                      else min(options, key=lambda o: (o[0], o[2].key)))
    tpot = _step_ms(d)
    if p is d:
        return d.key, PdDecision(LOCAL, None, "fleet", ttft, tpot, d.uncached_tokens)
    return d.key, PdDecision(REMOTE, p.key, "fleet", ttft, tpot, p.uncached_tokens)


def _step_ms(w: FleetWorker) -> float:
    return w.decode_step_ms if w.decode_step_ms > 0 else DEFAULT_DECODE_STEP_MS


def pick_moves(workers: Sequence[FleetWorker], slo_tpot_ms: float, window_s: float = 2.0
               ) -> list[tuple[str, str, int]]:
    """(source key, destination key, how many decodes) to move now (module docstring); at most one
    move per source, each destination used once, the most loaded sources first; never onto a
    dedicated lean worker."""
    decoders = sorted((w for w in workers if w.can_decode), key=lambda w: (-w.decode_rows, w.key))
    moves: list[tuple[str, str, int]] = []
    lean = dedicated_lean(workers, slo_tpot_ms, window_s)
    taken: set[str] = {lean.key} if lean is not None else set()
    for src in decoders:
        if src.decode_rows < 2 or _step_ms(src) <= slo_tpot_ms or src.key in taken:
            continue
        room = [w for w in decoders if w is not src and w.key not in taken and w.decode_rows <= src.decode_rows - 2
                and has_room(w, slo_tpot_ms)]
        if not room:
            continue
        dst = min(room, key=lambda w: (w.decode_rows, w.key))
        moves.append((src.key, dst.key, min((src.decode_rows - dst.decode_rows) // 2, MAX_MOVES_PER_ROUND)))
        taken.update((src.key, dst.key))
    return moves
