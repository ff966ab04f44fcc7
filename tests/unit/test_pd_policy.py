"""pdserve.router.pd_policy: local vs remote prefill, on hand-computed cases.

Common figures: D prefills at R = 10,000 tok/s, decodes in t_dec = 10 ms, mixes in t_mix = 40 ms
under a budget B = 2,048, so c = (40 - 10) / 2048 = 0.0146484375 ms of step per prompt token.
A prompt of 4,000 uncached tokens: 400 ms of prefill at R; remote adds 2 ms + 4,000 x 1 us.
"""
from __future__ import annotations

import math

import pytest

from pdserve.router.pd_policy import (  # noqa: E402
    DEFAULT_DECODE_STEP_MS,
    DEFAULT_PREFILL_TOKENS_PER_S,
    LOCAL,
    REMOTE,
    DecodePlace,
    PdConfig,
    PrefillPlace,
    decayed_rate,
    decide,
    ms_per_prompt_token,
    tpot_ms,
    uncached_tokens,
)

approx = pytest.approx
CFG = PdConfig(slo_ttft_ms=1000, slo_tpot_ms=50, local_max_tokens=256, remote_overhead_ms=2,
               transfer_us_per_token=1, rate_window_s=2)
C = 30 / 2048


def dec(uncached: int, queued: int = 0, lam: float = 0.0, can_prefill: bool = True) -> DecodePlace:
    return DecodePlace(PrefillPlace("D", uncached, queued, 10_000.0), can_prefill=can_prefill, decode_step_ms=10.0,
                       mixed_step_ms=40.0, max_num_batched_tokens=2048, chunked_prefill=True, prefill_rate=lam)


def pre(key: str = "P", uncached: int = 4000, queued: int = 0, rate: float = 10_000.0) -> PrefillPlace:
    return PrefillPlace(key, uncached, queued, rate)


def test_short_prompt_stays_local_even_with_an_idle_prefill_worker() -> None:
    d = decide(dec(200), [pre(uncached=200)], CFG)
    assert (d.kind, d.prefill_key, d.reason) == (LOCAL, None, "short-prompt")
    assert d.ttft_ms == approx(20.0)                               # 1000 * 200 / 10,000
    assert d.tpot_ms == approx(10 / (1 - 100 * C / 1000))          # lam = 200 / 2 s


def test_long_prompt_and_idle_prefill_worker_go_remote() -> None:
    # D has 3,000 prompt tokens queued: local ttft = 1000 * 7,000 / 10,000 = 700 ms -> headroom 0.3
    # (tpot 10 / (1 - 2,000 * C / 1000) = 10.30 ms -> 0.79); idle P: 400 + 2 + 4 = 406 ms -> 0.594
    d = decide(dec(4000, queued=3000), [pre()], CFG)
    assert (d.kind, d.prefill_key, d.reason) == (REMOTE, "P", "slo-headroom")
    assert d.ttft_ms == approx(406.0) and d.tpot_ms == approx(10.0)


def test_idle_decode_worker_keeps_a_tie() -> None:
    # both idle, same rate: local 400 ms (headroom 0.6) vs remote 406 ms (0.594): within the margin
    d = decide(dec(4000), [pre()], CFG)
    assert (d.kind, d.reason) == (LOCAL, "slo-headroom") and d.ttft_ms == approx(400.0)


def test_decode_worker_near_its_tpot_slo_sends_prefill_away() -> None:
    cfg = PdConfig(slo_ttft_ms=1000, slo_tpot_ms=12, remote_overhead_ms=2, transfer_us_per_token=1)
    # lam_D = 10,000: remote tpot 10 / (1 - 0.146484375) = 11.716 (headroom 0.0236); local adds
    # 4,000 / 2 s: 10 / (1 - 0.17578125) = 12.133 (-0.0111); ttft terms 0.594 / 0.6
    assert tpot_ms(dec(4000, lam=10_000), 0, cfg, 10_000) == approx(10 / (1 - 10_000 * C / 1000))
    d = decide(dec(4000, lam=10_000), [pre()], cfg)
    assert (d.kind, d.reason) == (REMOTE, "slo-headroom") and d.tpot_ms == approx(11.7163, abs=1e-3)


def test_backed_up_prefill_worker_local_while_decode_step_within_tpot_slo() -> None:
    backed_up = pre(queued=20_000)     # remote ttft 1000 * 24,000 / 10,000 + 6 = 2,406 ms
    # lam_D = 40,000: local u = 42,000 * C / 1000 = 0.6152 -> tpot 25.99 ms (headroom 0.48)
    d = decide(dec(4000, lam=40_000), [backed_up], CFG)
    assert (d.kind, d.reason) == (LOCAL, "slo-headroom")
    assert d.tpot_ms == approx(10 / (1 - 42_000 * C / 1000)) and d.ttft_ms == approx(400.0)
    # past the TPOT SLO (lam_D 55,000: local 60.59 ms, headroom -0.21) and a prefill worker
    # only just over its TTFT SLO (6,000 queued: 1,006 ms, -0.006; tpot 51.46, -0.029): remote
    d = decide(dec(4000, lam=55_000), [pre(queued=6000)], CFG)
    assert (d.kind, d.ttft_ms) == (REMOTE, approx(1006.0))
    # ... but with the prefill worker far behind (-1.406) local still violates least
    assert decide(dec(4000, lam=55_000), [backed_up], CFG).kind == LOCAL


def test_cache_affinity() -> None:
    # D holds 3,900 of the 4,000 tokens: 100 to compute -> local, although P is idle
    assert decide(dec(100, queued=3000), [pre()], CFG).reason == "short-prompt"
    # among remote candidates the one holding the prefix wins: P1 computes 500 tokens
    # (50 + 2 + 4 = 56 ms), P2 all 4,000 (406 ms)
    d = decide(dec(4000, queued=3000), [pre("P2"), pre("P1", uncached=500)], CFG)
    assert (d.kind, d.prefill_key, d.ttft_ms, d.prefill_tokens) == (REMOTE, "P1", approx(56.0), 500)
    assert uncached_tokens(64, 2, 16) == 32
    assert uncached_tokens(64, 4, 16) == 1          # the last token is always computed
    assert uncached_tokens(64, 0, 0) == 64


def test_recent_work_above_the_mean_spreads_new_conversations() -> None:
    # a new conversation shares a 2,500-token system prompt with P1 (1,500 tokens left to
    # compute: 150 ms) but P1 computed 4,500 tokens lately, P2 and P3 none: mean 1,500, P1's
    # excess 3,000 -> rank 150 + 300 = 450 ms against P2's 400 ms (all 4,000 tokens): P2,
    # reported with P2's estimate (400 + 2 + 4 ms)
    hot, cold = pre("P1", uncached=1500), pre("P2")
    hot.recent_tokens = 4500.0
    d = decide(dec(4000, queued=3000), [hot, cold, pre("P3")], CFG)
    assert (d.kind, d.prefill_key, d.ttft_ms, d.prefill_tokens) == (REMOTE, "P2", approx(406.0), 4000)
    # a next turn whose history P1 holds (200 tokens to compute: 20 + 300 = 320 ms) stays on P1,
    # and the decision reports P1's estimate, not its rank: 20 + 2 + 4 = 26 ms
    hot.uncached_tokens = 200
    d = decide(dec(4000, queued=3000), [hot, cold, pre("P3")], CFG)
    assert (d.prefill_key, d.ttft_ms, d.prefill_tokens) == ("P1", approx(26.0), 200)
    # alpha 0 (cache affinity and queues only): the new conversation goes to P1 (150 ms)
    hot.uncached_tokens = 1500
    assert decide(dec(4000, queued=3000), [hot, cold, pre("P3")], CFG, alpha=0.0).prefill_key == "P1"
    # equal recent work is no excess: the lowest ttft wins
    cold.recent_tokens = 4500.0
    assert decide(dec(4000, queued=3000), [hot, cold], CFG).prefill_key == "P1"


def test_modes_roles_and_missing_candidates() -> None:
    never = PdConfig(mode="never")
    assert decide(dec(4000, queued=3000), [pre()], never).reason == "never"
    always = PdConfig(mode="always", remote_overhead_ms=2, transfer_us_per_token=1)
    d = decide(dec(10), [pre("P1", queued=1000), pre("P2")], always)
    assert (d.kind, d.prefill_key, d.reason) == (REMOTE, "P2", "always")
    assert d.ttft_ms == approx(400 + 2 + 0.01)       # P2: 4,000 tokens; transfer of D's 10
    assert decide(dec(4000), [], always).reason == "no-prefill-worker"
    assert decide(dec(4000), [PrefillPlace("D", 4000)], CFG).reason == "no-prefill-worker"   # D is no candidate
    assert decide(dec(10, can_prefill=False), [pre()], CFG).reason == "decode-only"


def test_unmeasured_figures_use_peers_then_defaults() -> None:
    d = DecodePlace(PrefillPlace("D", 4000))                          # nothing measured anywhere
    res = decide(d, [pre(rate=0.0)], CFG)
    assert res.ttft_ms == approx(1000 * 4000 / DEFAULT_PREFILL_TOKENS_PER_S)
    # t_mix defaults to t_dec + 1000 * B / R: c = 1000 / R whatever B
    no_mix = DecodePlace(PrefillPlace("D", 4000), max_num_batched_tokens=512)
    assert ms_per_prompt_token(no_mix, 20_000.0) == approx(1000 / 20_000)
    # a measured peer's rate stands in for an unmeasured one: 1000 * 4,000 / 20,000 = 200 ms
    assert decide(d, [pre(rate=20_000.0, queued=100_000)], CFG).ttft_ms == approx(200.0)
    assert tpot_ms(d, 0, CFG, 10_000) == approx(DEFAULT_DECODE_STEP_MS)
    # without chunked prefill a prompt stalls every row: c = 1000 / R
    whole = DecodePlace(PrefillPlace("D", 4000, 0, 10_000.0), decode_step_ms=10, chunked_prefill=False,
                        max_num_batched_tokens=8192)
    assert ms_per_prompt_token(whole, 1.0) == approx(0.1)


def test_config_is_validated_and_rates_decay() -> None:
    with pytest.raises(ValueError, match="pd policy"):
        PdConfig(mode="")           # names are checked by pdserve/router/placement_policies.py
    with pytest.raises(ValueError, match="slo_tpot_ms"):
        PdConfig(slo_tpot_ms=0)
    with pytest.raises(ValueError, match="slo_ttft_ms must be finite"):
        PdConfig(slo_ttft_ms=math.inf)
    assert decayed_rate(2000.0, 10.0, 12.0, 2.0) == approx(2000 / math.e)
    assert decayed_rate(2000.0, 10.0, 9.0, 2.0) == 2000.0


def test_decide_workers_equals_decide_on_random_fleets() -> None:
    """The router's path (``decide_workers`` over worker objects and the prefix match) makes the
    same decision as ``decide`` over the PrefillPlaces built from them, ties and unmeasured rates
    included."""
    import random
    from types import SimpleNamespace

    from pdserve.router.pd_policy import decide_workers

    rng = random.Random(7)
    bs = 16
    for _ in range(500):
        n = rng.randint(1, 64) * bs + rng.randint(0, bs - 1)
        workers = [SimpleNamespace(key=f"p{i}", queued_prompt_tokens=rng.choice([0, 0, 512, rng.randrange(4000)]),
                                   prefill_tokens_per_s=rng.choice([0.0, 8000.0, 12000.0]),
                                   prefill_counter=rng.choice([0.0, 0.0, 1000.0, rng.uniform(0, 8000)]),
                                   prefill_counter_at=rng.uniform(90.0, 100.0))
                   for i in range(rng.randint(1, 8))]
        matched = {w.key: rng.randint(1, n // bs + 2) for w in workers if rng.random() < 0.5}
        d = DecodePlace(PrefillPlace("D", uncached_tokens(n, rng.randint(0, n // bs), bs), rng.randrange(3000),
                                     rng.choice([0.0, 10_000.0])),
                        can_prefill=rng.random() < 0.5, decode_step_ms=10.0, mixed_step_ms=40.0,
                        max_num_batched_tokens=2048, prefill_rate=rng.choice([0.0, 3000.0]))
        places = [PrefillPlace(w.key, uncached_tokens(n, matched.get(w.key, 0), bs), w.queued_prompt_tokens,
                               w.prefill_tokens_per_s,
                               decayed_rate(w.prefill_counter, w.prefill_counter_at, 100.0, 2.0)) for w in workers]
        cfg = PdConfig(mode=rng.choice(["adaptive", "always"]), local_max_tokens=rng.choice([0, 256]),
                       rate_window_s=2.0)
        alpha = rng.choice([0.0, 1.0, 2.5])
        assert decide_workers(d, workers, matched, n, bs, cfg, alpha, 100.0) == decide(d, places, cfg, alpha)
