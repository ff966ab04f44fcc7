"""Lab: the router's prefill placement (pdserve/router/pd_policy.py) on modelled GPUs, in one
process, in simulated time, so that a policy can be tried on the SLO-capacity benchmark before a
device call.

    python -m bench.pd_lab --workload prefill-heavy --deploy disagg,colocated,adaptive,adaptive2 [--rule waiting]

The same workloads (pdserve.loadtest.datasets, a variant per run), arrival times
(pdserve.loadtest.arrivals), capacity search (pdserve.loadtest.capacity) and policy functions
(``pd_policy.decide`` over the figures a router has: step times from the engine's own StepTimer,
polled every ``POLL_S``; queued prompt tokens; the decayed counters) as the served benchmark;
only the GPUs are a model (GpuModel: a step's time from its decode rows' context and its prompt
tokens, fitted to the Qwen3-8B geometry on one H200, bench/results/capacity_h200x2/). Workers run
steps back to back: a prefill worker batches queued prompts up to its budget; a decode or both
worker decodes its rows and, role both, adds up to its budget of prompt tokens (chunked
prefill). A remote prompt's KV reaches the decode worker ``transfer_ms`` + its uncached tokens x
``transfer_us_per_token`` after the prefill. Prefix caches: a worker holds a shared prompt once
it computed or received it (no eviction). Decode placement among several decode-capable
workers: the most cached prompt tokens minus load above the mean (router/policy.py at pressure 1).

``--rule waiting`` tries a candidate rule for the adaptive mode (:func:`decide_waiting`) in
place of the router's; ``--rule lean`` another, for deployments of role-both workers only
(:meth:`Lab.route_lean`). Deployment ``fleet`` is two both workers at budget ``--both-budget``
under the router's ``--pd-policy fleet`` (pdserve/router/fleet_policy.py; ``pdserve up --placement
fleet``); ``fleet-mixed`` the same at budget MIXED[0], MIXED[1] in steps with decode rows
(``--max-mixed-batched-tokens``); ``fleet-guard`` (the same policy) and ``colocated-guard`` (two
both workers, all local) run their workers with the engine's TPOT guard
(pdserve/common/engine/tpot_guard.py, target = the TPOT SLO, ceiling GUARDED_BUDGET): a step
with decode rows carries the prompt tokens the guard allows from the worker's own StepTimer, a
step without takes the ceiling.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from dataclasses import asdict

from bench.pd_lab_model import WORKLOADS, GpuModel, Req, Worker, metrics, requests_at
from pdserve.common.engine.tpot_guard import TpotGuard
from pdserve.common.serving.worker_args import GUARDED_BUDGET
from pdserve.loadtest import capacity
from pdserve.router import fleet_policy
from pdserve.router import pd_policy as pd

POLL_S = 0.5                    # the router's GetStats period
LEAN_MARGIN = 0.8               # --rule lean: a decode worker is full at this share of the TPOT SLO
DEPLOYS = {                     # roles, policy mode
    "disagg": (("prefill", "decode"), "always"),
    "colocated": (("both", "both"), "never"),
    "adaptive": (("prefill", "both"), "adaptive"),
    "adaptive2": (("both", "both"), "adaptive"),
    "colocated-guard": (("both", "both"), "never"),
    "fleet": (("both", "both"), "fleet"),            # pdserve up --placement fleet: no guard, budget 512
    "fleet-guard": (("both", "both"), "fleet"),
    "fleet-mixed": (("both", "both"), "fleet"),      # budget MIXED[0], MIXED[1] in steps with decode rows
}
GUARDED = {"colocated-guard", "fleet-guard"}     # deployments whose workers run the TPOT guard
MIXED = (8192, 512)             # fleet-mixed: --max-num-batched-tokens, --max-mixed-batched-tokens


def decide_waiting(d: pd.DecodePlace, cands: list[pd.PrefillPlace], cfg: pd.PdConfig, rows: int) -> pd.PdDecision:
    """Candidate rule (adaptive mode, D of role both): among the options whose estimates keep both
    SLOs, the one that costs less waiting: local makes D's ``rows`` decode rows each wait ``U * c``
    (the chunk's extra step time), remote makes this request wait ``ttft(remote) - ttft(local)``;
    when only one keeps them, that one; when neither, the router's most-headroom rule. Without
    the router's short-prompt rule and local tie: one request's effect on D's TPOT is always
    small, but all of them together are not."""
    if cfg.mode != "adaptive" or not cands or not d.can_prefill:
        return pd.decide(d, cands, cfg)
    fallback = pd.fallback_rate([d.place, *cands])
    t_rem, key, u_rem = pd.fastest_remote(d, cands, cfg, fallback)
    s_rem = pd.tpot_ms(d, 0, cfg, fallback)
    t_loc, s_loc = pd.ttft_local_ms(d, fallback), pd.tpot_ms(d, d.place.uncached_tokens, cfg, fallback)
    ok_rem = t_rem <= cfg.slo_ttft_ms and s_rem <= cfg.slo_tpot_ms
    ok_loc = t_loc <= cfg.slo_ttft_ms and s_loc <= cfg.slo_tpot_ms
    if ok_rem and ok_loc:
        local = rows * d.place.uncached_tokens * pd.ms_per_prompt_token(d, fallback) <= t_rem - t_loc
    elif ok_rem != ok_loc:
        local = ok_loc
    else:
        local = pd.headroom(t_loc, s_loc, cfg) + pd.TIE_MARGIN >= pd.headroom(t_rem, s_rem, cfg)
    if local:
        return pd.PdDecision(pd.LOCAL, None, "waiting", t_loc, s_loc, d.place.uncached_tokens)
    return pd.PdDecision(pd.REMOTE, key, "waiting", t_rem, s_rem, u_rem)


class Lab:
    """One run: a deployment, a list of requests with their arrival times."""

    def __init__(self, roles: tuple[str, ...], mode: str, gpu: GpuModel, slo_ttft: float, slo_tpot: float,
                 both_budget: int, prefix_len: int, rule: str = "router", guard_ms: float = 0.0,
                 mixed: tuple[int, int] | None = None) -> None:
        budgets = {"prefill": 16384, "decode": 2048, "both": GUARDED_BUDGET if guard_ms else both_budget}
        if mixed is not None:
            budgets["both"] = mixed[0]
        self.workers = [Worker(f"w{i}", r, budgets[r], mixed=mixed[1] if mixed and r == "both" else 0)
                        for i, r in enumerate(roles)]
        for w in self.workers:
            if guard_ms and w.role != "prefill":
                w.guard = TpotGuard(w.timer, guard_ms, fleet_policy.GUARD_MARGIN)
        self.fleet = mode == "fleet"
        self.cfg = pd.PdConfig(mode="never" if self.fleet else mode, slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot)
        self.gpu, self.prefix_len = gpu, prefix_len
        self.events: list = []
        self.seq = itertools.count()
        self.local = 0                  # requests prefilled on their decode worker
        self.rule = rule                # router (pd_policy.decide) | waiting (decide_waiting) | lean (route_lean)

    def at(self, t: float, kind: str, *payload) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def uncached(self, w: Worker, r: Req) -> int:
        return r.prompt_len - (self.prefix_len if r.prefix is not None and r.prefix in w.cached else 0)

    def run(self, reqs: list[Req]) -> list[Req]:
        for r in reqs:
            self.at(r.arrival, "arrive", r)
        self.at(0.0, "poll")
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.route(payload[0], now)
            elif kind == "step":
                self.end_step(now, *payload)
            elif kind == "land":
                payload[0].rows.append(payload[1])
                payload[0].cached.add(payload[1].prefix)
                self.start_step(payload[0], now)
            elif any(not r.tokens or len(r.tokens) < r.out_len for r in reqs):
                for w in self.workers:
                    w.stats = (w.timer.decode_step_ms, w.timer.mixed_step_ms, w.timer.prefill_tokens_per_s)
                self.at(now + POLL_S, "poll")
        return reqs

    def pick_decode(self, r: Req) -> Worker:
        cands = [w for w in self.workers if w.role != "prefill"]
        load = {w.key: sum(x.prompt_len + len(x.tokens) for x in w.rows) + w.queued_tokens() for w in cands}
        mean = sum(load.values()) / len(cands)
        return max(cands, key=lambda w: (r.prompt_len - self.uncached(w, r) - max(0.0, load[w.key] - mean),
                                         -load[w.key]))

    def route(self, r: Req, now: float) -> None:
        if self.fleet:
            return self.route_fleet(r, now)
        if self.rule == "lean" and self.cfg.mode == "adaptive" and all(w.role == "both" for w in self.workers):
            return self.route_lean(r, now)
        d = r.decode_worker = self.pick_decode(r)
        t_dec, t_mix, rate = d.stats
        window = self.cfg.rate_window_s
        own = pd.PrefillPlace(d.key, self.uncached(d, r), d.queued_tokens(), rate)
        place = pd.DecodePlace(own, d.role == "both", t_dec, t_mix, d.budget, True,
                               pd.decayed_rate(d.counter, d.counter_at, now, window) / window)
        cands = [pd.PrefillPlace(w.key, self.uncached(w, r), w.queued_tokens(), w.stats[2],
                                 pd.decayed_rate(w.counter, w.counter_at, now, window))
                 for w in self.workers if w is not d and w.role != "decode"]
        decision = (decide_waiting(place, cands, self.cfg, len(d.rows)) if self.rule == "waiting"
                    else pd.decide(place, cands, self.cfg))
        where = d if decision.kind == pd.LOCAL else next(w for w in self.workers if w.key == decision.prefill_key)
        self.local += where is d
        where.give(decision.prefill_tokens, now, window)
        where.queue.append([r, max(1, decision.prefill_tokens)])
        self.start_step(where, now)

    def place(self, w: Worker, uncached: int, now: float) -> pd.DecodePlace:
        t_dec, t_mix, rate = w.stats
        window = self.cfg.rate_window_s
        return pd.DecodePlace(pd.PrefillPlace(w.key, uncached, w.queued_tokens(), rate), True, t_dec, t_mix,
                              w.budget, True, pd.decayed_rate(w.counter, w.counter_at, now, window) / window)

    def route_lean(self, r: Req, now: float) -> None:
        """Candidate rule for role-both workers: the worker that computed the most prompt tokens
        lately leans to prefill; a request decodes on another while that one's TPOT estimate stays
        within LEAN_MARGIN of the SLO (the fewest rows first), else where the fewest rows are. It
        is prefilled where its estimates keep both SLOs at the least waiting: the worker's decode
        rows each wait ``U * c``, the request waits its TTFT (plus the transfer when remote)."""
        cfg, window, fallback = self.cfg, self.cfg.rate_window_s, pd.DEFAULT_PREFILL_TOKENS_PER_S
        lean = max(self.workers, key=lambda w: pd.decayed_rate(w.counter, w.counter_at, now, window))
        others = sorted((w for w in self.workers if w is not lean), key=lambda w: len(w.rows))
        fits = [w for w in others
                if pd.tpot_ms(self.place(w, 0, now), 0, cfg, fallback) <= LEAN_MARGIN * cfg.slo_tpot_ms]
        d = r.decode_worker = fits[0] if fits else min(self.workers, key=lambda w: len(w.rows))
        options = []
        for w in self.workers:
            u = self.uncached(w, r)
            place = self.place(w, u, now)
            ttft = 1000.0 * (w.queued_tokens() + u) / (w.stats[2] or fallback)
            if w is not d:
                ttft += self.gpu.transfer_ms + self.uncached(d, r) * self.gpu.transfer_us_per_token / 1000.0
            keeps = ttft <= cfg.slo_ttft_ms and pd.tpot_ms(place, u, cfg, fallback) <= cfg.slo_tpot_ms
            waiting = len(w.rows) * u * pd.ms_per_prompt_token(place, fallback) + ttft
            options.append((not keeps, waiting, w.key, w, u))
        _, _, _, where, u = min(options)
        self.local += where is d
        where.give(u, now, window)
        where.queue.append([r, max(1, u)])
        self.start_step(where, now)

    def route_fleet(self, r: Req, now: float) -> None:
        """The router's ``--pd-policy fleet`` (fleet_policy.decide) over the workers' figures."""
        window = self.cfg.rate_window_s
        snaps = [fleet_policy.FleetWorker(
            w.key, self.uncached(w, r), w.queued_tokens(), w.stats[2], len(w.rows), w.stats[0],
            w.timer.ms_per_prompt_token, w.mixed_budget, pd.decayed_rate(w.counter, w.counter_at, now, window),
            guarded=w.guard is not None)
            for w in self.workers]
        d_key, decision = fleet_policy.decide(snaps, self.cfg, self.pick_decode(r).key)
        by_key = {w.key: w for w in self.workers}
        d = r.decode_worker = by_key[d_key]
        where = d if decision.kind == pd.LOCAL else by_key[decision.prefill_key]
        self.local += where is d
        where.give(decision.prefill_tokens, now, window)
        where.queue.append([r, max(1, decision.prefill_tokens)])
        self.start_step(where, now)

    def room(self, w: Worker) -> int:
        """Prompt tokens ``w``'s next step may carry (its budget less its decode rows; the TPOT
        guard's budget beside decode rows when it runs one)."""
        if w.role == "prefill":
            return w.budget
        room = (w.mixed_budget if w.rows else w.budget) - len(w.rows)
        if w.guard is not None and w.rows:
            room = min(room, w.guard.budget(w.rows, room))
        return room

    def kv_tokens(self, rows: list[Req]) -> float:
        """Context tokens a decode step reads from DRAM: every row its whole context, but a
        shared prefix's other readers in the same step only ``GpuModel.prefix_reread`` of it (its
        blocks, a few MB a layer, are partly served from L2)."""
        f = self.gpu.prefix_reread
        with_prefix = [x for x in rows if x.prefix is not None]
        shared = len({x.prefix for x in with_prefix})
        total = sum(x.prompt_len + len(x.tokens) for x in rows)
        return total - (1.0 - f) * self.prefix_len * (len(with_prefix) - shared)

    def start_step(self, w: Worker, now: float) -> None:
        if w.busy:
            return
        chunk: list[tuple[list, int]] = []
        room = self.room(w)
        for item in w.queue:
            if room <= 0:
                break
            if w.role == "prefill":         # whole prompts a batch (one over the budget runs alone)
                if chunk and item[1] > room:
                    break
                n = item[1]
            else:                           # chunked prefill
                n = min(item[1], room)
            chunk.append((item, n))
            room -= n
        rows = list(w.rows)
        if not rows and not chunk:
            return
        ctx = self.kv_tokens(rows)
        tokens = sum(n for _, n in chunk)
        ms = self.gpu.step_ms(len(rows), ctx, tokens, w.role != "prefill" and (bool(rows) or tokens < 2048))
        w.busy = True
        self.at(now + ms / 1000.0, "step", w, rows, chunk, ms, tokens)

    def end_step(self, now: float, w: Worker, rows: list, chunk: list, ms: float, tokens: int) -> None:
        w.busy = False
        w.timer.record(ms / 1000.0, tokens, len(rows))
        if w.guard is not None:
            w.guard.observe(ms, len(rows))
        for x in rows:
            x.tokens.append(now)
            if len(x.tokens) >= x.out_len:
                w.rows.remove(x)
        for item, n in chunk:
            item[1] -= n
            if item[1] > 0:
                continue
            w.queue.remove(item)
            r = item[0]
            r.tokens.append(now)                        # the first token, at the prefill's end
            w.cached.add(r.prefix)
            d = r.decode_worker
            if r.out_len <= 1:
                continue
            if d is w:
                w.rows.append(r)
            else:
                lands = self.gpu.transfer_ms + self.uncached(d, r) * self.gpu.transfer_us_per_token / 1000.0
                self.at(now + lands / 1000.0, "land", d, r)
        self.start_step(w, now)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=[*sorted(WORKLOADS), "phases"], default="prefill-heavy",
                   help="phases: the load tool's --dataset phases (rate = the base rate)")
    p.add_argument("--phase-seconds", type=float, default=45.0)
    p.add_argument("--deploy", default="disagg,colocated,adaptive,adaptive2")
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--rates", default="6,10,14,18,22")
    p.add_argument("--tolerance", type=float, default=1.0)
    p.add_argument("--slo", default="1000,12,30", help="TTFT ms, TPOT ms, ITL p99 ms")
    p.add_argument("--router-tpot-ms", type=float, default=0.0,
                   help="the adaptive router's TPOT SLO (0: the benchmark's)")
    p.add_argument("--both-budget", type=int, default=512)
    p.add_argument("--rule", choices=("router", "waiting", "lean"), default="router",
                   help="the adaptive mode's rule (module docstring)")
    p.add_argument("--gpu", choices=("h200", "h100"), default="h200", help="GpuModel.named")
    p.add_argument("--dedicate-at", type=float, default=fleet_policy.DEDICATE_AT,
                   help="fleet_policy.DEDICATE_AT for this run")
    p.add_argument("--dedicate-cause", type=float, default=fleet_policy.DEDICATE_CAUSE,
                   help="fleet_policy.DEDICATE_CAUSE for this run")
    p.add_argument("--out", default=None, help="write the capacities and every point here (JSON)")
    a = p.parse_args(argv)
    ttft, tpot, itl = (float(x) for x in a.slo.split(","))
    fleet_policy.DEDICATE_AT, fleet_policy.DEDICATE_CAUSE = a.dedicate_at, a.dedicate_cause
    gpu = GpuModel.named(a.gpu)
    prefix_len = WORKLOADS["shared-prefix" if a.workload == "phases" else a.workload].get("prefix_len", 0)
    out = {}
    for name in a.deploy.split(","):
        roles, mode = DEPLOYS[name]
        runs = itertools.count(1)

        guard = tpot if name in GUARDED else 0.0

        mixed = MIXED if name == "fleet-mixed" else None

        def run(rate: float, roles=roles, mode=mode, runs=runs, guard=guard, mixed=mixed) -> tuple[bool, dict]:
            lab = Lab(roles, mode, gpu, ttft, a.router_tpot_ms or tpot, a.both_budget, prefix_len, a.rule,
                      guard, mixed)
            reqs = requests_at(a.workload, a.num_prompts, rate, next(runs), a.phase_seconds)
            m = metrics(lab.run(reqs), ttft, tpot, itl)
            m["local_share"] = lab.local / len(reqs)
            return capacity.holds(m), {k: round(v, 3) for k, v in m.items()}

        search = capacity.CapacitySearch(rates=tuple(float(x) for x in a.rates.split(",")), tolerance=a.tolerance)
        cap = capacity.find_capacity(search, run)
        out[name] = cap.as_dict()
        print(f"{name:10s} capacity {cap.capacity:g} (failed at {cap.upper})  " + "  ".join(
            f"{q['rate']:g}:{q['slo_attainment']:.2f}/{q['mean_tpot_ms']:.1f}ms/{q['mean_ttft_ms']:.0f}ms/itl{q['itl_p99_ms']:.0f}/"
            f"{q['local_share']:.0%}"
            for q in cap.points), flush=True)
    summary = {"workload": a.workload, "rule": a.rule, "capacity": {k: v["capacity"] for k, v in out.items()}}
    print(json.dumps(summary))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**summary, "argv": sys.argv[1:] if argv is None else argv, "gpu_model": asdict(gpu),
                       "deployments": out}, f, indent=1)


if __name__ == "__main__":
    main()
