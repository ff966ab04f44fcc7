"""The placement lab (bench/pd_lab.py): its step model by hand, whole runs whose every request
gets its tokens where the mode says, and the candidate rule's choices by hand."""
from __future__ import annotations

import pytest

from bench import pd_lab
from pdserve.router import pd_policy as pd


def test_step_model_by_hand():
    gpu = pd_lab.GpuModel()
    # a decode step: fixed 2 + weights 3.4 + KV 0.027 ms per 1,000 tokens of context
    assert gpu.step_ms(rows=10, context_tokens=30_000, prompt_tokens=0, chunked=True) == pytest.approx(2 + 3.4 + 0.81)
    # prompt tokens cost what their compute exceeds the weight read by: 512 x 0.028 = 14.336 > 3.4
    assert gpu.step_ms(2, 2000, 512, chunked=True) == pytest.approx(2 + 14.336 + 0.054)
    assert gpu.step_ms(0, 0, 100, chunked=False) == pytest.approx(2 + 3.4)          # 2.5 ms of compute < 3.4
    assert gpu.step_ms(0, 0, 16384, chunked=False) == pytest.approx(2 + 16384 * 0.025)


def test_a_shared_prefix_is_read_again_at_its_reread_share():
    # two rows on prefix "p" (2,100-token prompts, 10 tokens out) and one without (500, 5): 4,725
    # context tokens; the second reader of "p" reads 0.6 of its 2,000 shared tokens: 4,725 - 800
    rows = [pd_lab.Req(0.0, 2100, 50, "p", tokens=[0.0] * 10), pd_lab.Req(0.0, 2100, 50, "p", tokens=[0.0] * 10),
            pd_lab.Req(0.0, 500, 50, None, tokens=[0.0] * 5)]
    lab = pd_lab.Lab(("both",), "never", pd_lab.GpuModel(prefix_reread=0.6), 1000.0, 12.0, 512, prefix_len=2000)
    assert lab.kv_tokens(rows) == pytest.approx(3925.0)
    lab.gpu = pd_lab.GpuModel()                         # the H200 model: every row reads its whole context
    assert lab.kv_tokens(rows) == pytest.approx(4725.0)


@pytest.mark.parametrize("deploy", ["disagg", "colocated", "adaptive", "adaptive2"])
def test_every_request_gets_its_tokens_where_the_mode_says(deploy):
    roles, mode = pd_lab.DEPLOYS[deploy]
    lab = pd_lab.Lab(roles, mode, pd_lab.GpuModel(), 1000.0, 12.0, 512, prefix_len=0)
    reqs = lab.run(pd_lab.requests_at("prefill-heavy", 30, 4.0, variant=1))
    for r in reqs:
        assert len(r.tokens) == r.out_len and r.tokens == sorted(r.tokens)
        # the first token no earlier than the prompt's compute alone (a chunked worker's or a batch's)
        assert r.tokens[0] - r.arrival >= (2 + r.prompt_len * 0.025) / 1000 - 1e-9
    assert lab.local == {"always": 0, "never": 30}.get(mode, lab.local)
    assert not lab.events and all(not w.rows and not w.queue and not w.busy for w in lab.workers)
    m = pd_lab.metrics(reqs, 1000.0, 12.0, 30.0)
    assert 0 < m["slo_attainment"] <= 1 and m["mean_ttft_ms"] > 0


def _place(rows_tokens_queued: int = 0, step_ms: float = 8.0) -> pd.DecodePlace:
    own = pd.PrefillPlace("d", uncached_tokens=300, queued_tokens=rows_tokens_queued, tokens_per_s=40_000)
    # c = (t_mix - t_dec) / B = (20.8 - 8) / 512 = 0.025 ms a prompt token
    return pd.DecodePlace(own, True, step_ms, 20.8, 512, True, prefill_rate=0.0)


def test_waiting_rule_by_hand():
    cfg = pd.PdConfig(mode="adaptive", slo_ttft_ms=1000, slo_tpot_ms=12)
    idle_p = [pd.PrefillPlace("p", 300, 0, 40_000)]
    # ttft local 7.5 ms, remote 7.5 + 2 + 0.3 = 9.8 ms: local costs 60 rows x 300 x 0.025 = 450 ms of
    # waiting against 2.3 ms for this request: remote (the router's rules keep a 300-token prompt local)
    assert pd_lab.decide_waiting(_place(), idle_p, cfg, rows=60).kind == pd.REMOTE
    router = pd.decide(_place(), idle_p, cfg)      # a tie for the router: the prompt's TPOT effect is 0.03 ms
    assert (router.kind, router.reason) == (pd.LOCAL, "slo-headroom")
    # an idle decode worker: no row waits, local
    assert pd_lab.decide_waiting(_place(), idle_p, cfg, rows=0).kind == pd.LOCAL
    # the prefill worker's queue would miss the TTFT SLO (45,000 tokens at 40,000/s): local
    busy_p = [pd.PrefillPlace("p", 300, 45_000, 40_000)]
    assert pd_lab.decide_waiting(_place(), busy_p, cfg, rows=60).kind == pd.LOCAL
    # D's decode step misses TPOT either way and P's queue TTFT: the router's most-headroom rule
    # (remote -0.167 by its TPOT of 14.0 ms, local -0.171 by 14.05 ms: within the tie margin, local)
    slow = _place(step_ms=14.0)
    assert pd_lab.decide_waiting(slow, busy_p, cfg, rows=60).kind == pd.LOCAL
    assert pd_lab.decide_waiting(slow, busy_p, cfg, rows=60).reason == "waiting"


def test_lean_rule_splits_two_both_workers_under_prefill_heavy_load():
    """--rule lean: one worker ends up decoding nearly every request, the other prefilling them."""
    lab = pd_lab.Lab(("both", "both"), "adaptive", pd_lab.GpuModel(), 1000.0, 12.0, 512, 0, rule="lean")
    reqs = lab.run(pd_lab.requests_at("prefill-heavy", 80, 8.0, variant=1))
    assert all(len(r.tokens) == r.out_len for r in reqs)
    decoded = sorted(sum(r.decode_worker is w for r in reqs) for w in lab.workers)
    assert decoded[1] >= 0.8 * len(reqs) and lab.local <= 0.2 * len(reqs)
