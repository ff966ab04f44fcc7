"""Figures of a simulation run from the workers' GetStats samples and the routers' /metrics:
pure functions (hand-checked in tests/unit/test_scale_sim.py)."""
from __future__ import annotations

import re
from collections.abc import Sequence

Samples = Sequence[tuple[float, dict]]   # [(t, {address: WorkerStats})]


def hit_rate(samples: Samples, addresses: Sequence[str]) -> float:
    """Prompt tokens found in the prefix caches / prompt tokens looked up, over the run:
    per worker its last sample minus its first (a worker that died counts up to its death)."""
    hit = query = 0
    for a in addresses:
        seen = [s[a] for _, s in samples if a in s]
        if len(seen) >= 1:
            hit += seen[-1].prefix_cache_hit_tokens - (seen[0].prefix_cache_hit_tokens if len(seen) > 1 else 0)
            query += seen[-1].prefix_cache_query_tokens - (seen[0].prefix_cache_query_tokens if len(seen) > 1 else 0)
    return hit / query if query else 0.0


def imbalance(samples: Samples, addresses: Sequence[str]) -> dict[str, float]:
    """max / mean of the decode workers' tokens in flight (context tokens of running requests),
    per sample with any load; mean and p90 over those samples.

    ``floor_mean``: the same statistic's lower bound for any placement, per sample: R requests
    on N workers leave some worker with ceil(R / N) of them, so even equal requests placed
    perfectly give max/mean >= ceil(R / N) / (R / N) (2.0 for 33 requests on 32 workers; 1.0
    only when N divides R). ``mean_requests_in_flight``: R, for the regime the figure describes.
    ``saturated_mean`` / ``saturated_samples``: the statistic over the samples with R >= 4 N
    only (a fleet running four or more requests per worker: floor <= 1.25)."""
    ratios, floors, inflight, saturated = [], [], [], []
    for _, s in samples:
        loads = [s[a].num_running_context_tokens for a in addresses if a in s]
        total = sum(loads)
        if loads and total > 0:
            ratio = max(loads) / (total / len(loads))
            ratios.append(ratio)
            r = sum(s[a].num_running for a in addresses if a in s)
            if r:
                floors.append(-(-r // len(loads)) / (r / len(loads)))
                inflight.append(r)
            if r >= 4 * len(loads):
                saturated.append(ratio)
    if not ratios:
        return {"mean": 0.0, "p90": 0.0, "samples": 0, "floor_mean": 0.0, "mean_requests_in_flight": 0.0,
                "saturated_mean": 0.0, "saturated_samples": 0}
    ratios.sort()
    return {"mean": sum(ratios) / len(ratios), "p90": ratios[min(len(ratios) - 1, int(0.9 * len(ratios)))],
            "samples": len(ratios), "floor_mean": sum(floors) / len(floors) if floors else 0.0,
            "mean_requests_in_flight": sum(inflight) / len(inflight) if inflight else 0.0,
            "saturated_mean": sum(saturated) / len(saturated) if saturated else 0.0,
            "saturated_samples": len(saturated)}


def hit_rate_timeline(samples: Samples, addresses: Sequence[str]) -> list[tuple[float, float]]:
    """(t, hit rate of the prompt tokens looked up since the previous sample), over ``addresses``
    that answered in both samples."""
    out = []
    for (_, a), (t, b) in zip(samples, samples[1:]):
        hit = sum(b[x].prefix_cache_hit_tokens - a[x].prefix_cache_hit_tokens for x in addresses if x in a and x in b)
        q = sum(b[x].prefix_cache_query_tokens - a[x].prefix_cache_query_tokens for x in addresses if x in a and x in b)
        if q > 0:
            out.append((t, hit / q))
    return out


def channel_counts(samples: Samples, addresses: Sequence[str]) -> dict[str, float]:
    """Open pair channels per (prefill) worker: the most seen, and the mean of the last sample."""
    most = max((s[a].num_open_kv_channels for _, s in samples for a in addresses if a in s), default=0)
    last = [samples[-1][1][a].num_open_kv_channels for a in addresses if samples and a in samples[-1][1]]
    opened = sum(samples[-1][1][a].num_kv_channels_opened for a in addresses if samples and a in samples[-1][1])
    return {"max_open_per_worker": most, "mean_open_per_worker_at_end": sum(last) / len(last) if last else 0.0,
            "opened_total": opened}


def ttft_by_turn(ttfts_s: Sequence[float], turns: Sequence[int]) -> dict[int, dict[str, float]]:
    """Per conversation turn (0 = a conversation's first request): requests, TTFT p50 / p90 in ms
    (nearest rank: the value at index int(q * n) of the sorted list), and how many of the turn's
    requests are above the run's p90. ``ttfts_s``: seconds, <= 0 for a failed request (skipped);
    ``turns``: the turn of each request, same order."""
    done = [(t, k) for t, k in zip(ttfts_s, turns) if t > 0]
    if not done:
        return {}
    ranked = sorted(t for t, _ in done)
    p90_all = ranked[min(len(ranked) - 1, int(0.9 * len(ranked)))]
    out: dict[int, dict[str, float]] = {}
    for turn in sorted({k for _, k in done}):
        xs = sorted(t for t, k in done if k == turn)
        out[turn] = {"requests": len(xs), "p50_ttft_ms": 1000 * xs[len(xs) // 2],
                     "p90_ttft_ms": 1000 * xs[min(len(xs) - 1, int(0.9 * len(xs)))],
                     "above_run_p90": sum(1 for t in xs if t > p90_all)}
    return out


def counter_total(metrics_text: str, name: str) -> float:
    """The sum over label sets of a counter ``name`` (``name_total`` samples) in a /metrics page."""
    pattern = re.compile(rf"^{re.escape(name)}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", re.M)
    return sum(float(v) for v in pattern.findall(metrics_text))


_BUCKET = re.compile(r'^pdserve_router_decision_seconds_bucket\{le="([^"]+)"\} ([0-9.e+]+)$', re.M)


def decision_buckets(metrics_text: str) -> list[tuple[float, float]]:
    """(upper bound s, cumulative count) of the decision-time histogram in a /metrics page."""
    return [(float("inf") if le == "+Inf" else float(le), float(n)) for le, n in _BUCKET.findall(metrics_text)]


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile: linear inside the bucket that holds rank q * total."""
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


def merge_buckets(pages: Sequence[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Bucket-wise sum of several routers' histograms (same bounds)."""
    if not pages:
        return []
    return [(le, sum(p[i][1] for p in pages)) for i, (le, _) in enumerate(pages[0])]
