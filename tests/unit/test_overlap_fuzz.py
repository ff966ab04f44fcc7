"""Overlapped steps change nothing a caller can see: the same random traffic (requests arriving
while others run, stop tokens, one-token requests, prefill-only requests, cancellations, a pool
small enough to preempt) gives the same tokens and finish reasons with and without overlap, and
the pool is whole at the end. The same holds with chunked prefill under a budget smaller than
most prompts (mixed steps, partly prefilled sequences preempted), whose tokens also equal the
unchunked engine's."""
from __future__ import annotations

import random

import pytest

from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.outputs import FinishReason


def _traffic(seed: int, stops: dict[str, int]) -> list[tuple[int, str, list[int], SamplingParams, bool]]:
    """(arrival step, request id, prompt, params, prefill_only) for 24 requests."""
    rng = random.Random(seed)
    out = []
    for i in range(24):
        rid = f"r{i}"
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 90))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.choice([1, 2, 7, 19, 33]),
                                stop_token_ids=(stops[rid],) if rid in stops else (), ignore_eos=True)
        out.append((rng.randint(0, 40), rid, prompt, params, rng.random() < 0.15))
    return out


CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=16)
UNCHUNKED = dict(enable_chunked_prefill=False, max_num_batched_tokens=128)


def _run(overlap: bool, seed: int, stops: dict[str, int], chunking: dict = UNCHUNKED) -> tuple[dict, dict, int]:
    llm = LLM("tiny-qwen3", device="cpu", dtype="float32", block_size=16, num_kv_blocks=24, max_model_len=128,
              async_scheduling=overlap, **chunking)
    eng = llm.engine
    traffic = sorted(_traffic(seed, stops), key=lambda t: t[0])
    cancel_at = {12: "r3", 25: "r11"}
    results, held = {}, {}
    step = 0
    while traffic or eng.has_unfinished():
        while traffic and traffic[0][0] <= step:
            _, rid, prompt, params, prefill_only = traffic.pop(0)
            eng.add_request(prompt, params, request_id=rid, prefill_only=prefill_only)
        if step in cancel_at:
            seq = eng.abort(cancel_at[step])
            if seq is not None:
                results[seq.request_id] = (None, "cancelled")
        out = eng.step()
        for seq in out.finished:
            if seq.request_id in eng.kv_handoff.held:
                held[seq.request_id] = list(seq.token_ids)
            else:
                reason = seq.finish_reason.value if seq.finish_reason else None
                results[seq.request_id] = (seq.token_ids[seq.num_prompt_tokens:], reason)
        step += 1
        assert step < 5000
    for rid in list(eng.kv_handoff.held):
        eng.kv_handoff.release(eng.kv_handoff.held[rid])
    assert eng.block_manager.is_whole() and eng.pending is None
    return results, held, eng.scheduler.num_preemptions


@pytest.mark.parametrize("seed", [0, 2, 4])
def test_overlap_is_invisible(seed):
    first, _, _ = _run(False, seed, {})
    # a third of the requests stop on the 4th token they produced when nothing stopped them
    stops = {rid: tokens[3] for rid, (tokens, _) in sorted(first.items())[::3] if tokens and len(tokens) > 4}
    plain, plain_held, preemptions = _run(False, seed, stops)
    over, over_held, _ = _run(True, seed, stops)
    assert over_held == plain_held and plain_held
    # a cancel lands one step later under overlap: a request cancelled in either run is left out
    cancelled = {rid for rid, (_, reason) in [*plain.items(), *over.items()] if reason == "cancelled"}
    assert {rid: r for rid, r in over.items() if rid not in cancelled} == \
        {rid: r for rid, r in plain.items() if rid not in cancelled}
    assert FinishReason.STOP.value in {r for _, r in plain.values()} and preemptions > 0
    for overlap in (False, True):
        chunked, chunked_held, chunked_preemptions = _run(overlap, seed, stops, CHUNKED)
        assert chunked_held == plain_held and chunked_preemptions > 0
        cancelled_c = cancelled | {rid for rid, (_, reason) in chunked.items() if reason == "cancelled"}
        assert {rid: r for rid, r in chunked.items() if rid not in cancelled_c} == \
            {rid: r for rid, r in plain.items() if rid not in cancelled_c}
