"""n samples from one prefill (engine/fork.py): the prompt is prefilled once, each sample equals
a separate request with its own seed stream (``seed + index``), the forks share the prompt's
full blocks and own a copy of its last one, and every ending (finish, cancel of one sample or of
the request, preemption) leaves the pool whole (CPU, tiny model)."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.outputs import FinishReason

BS = 16


def _engine(num_kv_blocks: int = 64, **kw):
    kw.setdefault("enable_chunked_prefill", True)
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM("tiny-qwen3", device="cpu", dtype="float32", block_size=BS, num_kv_blocks=num_kv_blocks,
               max_model_len=256, max_num_seqs=8, **kw).engine


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 * salt) % 480 + 3 for i in range(n)]


def _run(eng, on_step=None) -> tuple[int, int]:
    """Step until idle; returns (prompt tokens computed, steps)."""
    prefill = steps = 0
    while eng.has_unfinished():
        out = eng.step()
        prefill += out.num_prefill_tokens
        steps += 1
        if on_step is not None:
            on_step(eng, steps)
    return prefill, steps


def _reference(prompt: list[int], params: SamplingParams, **kw) -> list[list[int]]:
    """Each sample as a request of its own (n 1, seed + i), in a fresh engine each."""
    outs = []
    for i in range(params.n):
        eng = _engine(**kw)
        seq = eng.add_request(prompt, params.for_sample(i))
        _run(eng)
        outs.append(seq.completion_token_ids)
    return outs


SEEDED = SamplingParams(n=4, seed=7, temperature=0.8, max_tokens=20, ignore_eos=True)
GREEDY = SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("prompt_len", [5, 32, 41])     # one partial block, exact blocks, full + partial
@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["seeded", "greedy"])
def test_n_samples_from_one_prefill_equal_separate_requests(prompt_len, params):
    prompt = _prompt(prompt_len)
    eng = _engine()
    seq = eng.add_request(prompt, params, request_id="r")
    prefill, _ = _run(eng)
    assert prefill == prompt_len                                  # the prompt computed once
    assert eng.block_manager.num_query_tokens == prompt_len       # one lookup, one allocation
    assert [s.index for s in seq.samples] == list(range(params.n))
    assert all(s.request_id == "r" and s.finish_reason is FinishReason.LENGTH for s in seq.samples)
    outs = [s.completion_token_ids for s in seq.samples]
    assert outs == _reference(prompt, params)
    if not params.is_greedy:
        assert len({tuple(o) for o in outs}) == params.n          # own seed streams
    assert eng.block_manager.is_whole() and not eng.requests


def test_forks_share_full_blocks_and_copy_the_last_one():
    prompt = _prompt(41)                     # blocks 0, 1 full, block 2 holds tokens 32..40
    eng = _engine()
    seq = eng.add_request(prompt, SamplingParams(n=4, temperature=0.0, max_tokens=8, ignore_eos=True))
    bm = eng.block_manager
    eng.step()                               # the whole prompt: sample 0's first token, the fork
    assert seq.forked and len(seq.samples) == 4 and not seq.fork_block_ids
    kids = seq.samples[1:]
    for k in kids:
        assert k.block_table[:2] == seq.block_table[:2] and k.block_table[2] != seq.block_table[2]
        assert k.num_cached_tokens == 40 and k.completion_token_ids == []
        kv = eng.model_runner.kv_cache
        assert torch.equal(kv[k.block_table[2], :, :, :8], kv[seq.block_table[2], :, :, :8])
    assert [bm.blocks[b].ref_count for b in seq.block_table[:3]] == [4, 4, 1]
    assert len({k.block_table[2] for k in kids}) == 3
    assert bm.num_used_blocks == 3 + 3      # 3 prompt blocks, 3 copies: nothing else taken
    _run(eng)
    assert bm.is_whole()


def test_admission_takes_the_fork_blocks_and_a_cancel_before_the_fork_frees_them():
    eng = _engine(max_num_batched_tokens=16)
    seq = eng.add_request(_prompt(41), SamplingParams(n=4, max_tokens=4), request_id="r")
    eng.step()                               # the first chunk of 16: admitted, not forked
    assert not seq.forked and len(seq.fork_block_ids) == 3
    assert eng.block_manager.num_used_blocks == 3 + 3
    assert eng.abort("r") is seq and seq.finish_reason is FinishReason.CANCELLED
    assert eng.block_manager.is_whole() and not eng.requests and not eng.has_unfinished()


def test_cancel_one_sample_frees_its_blocks_only():
    prompt = _prompt(41)
    eng = _engine()
    seq = eng.add_request(prompt, SEEDED, request_id="r")
    bm = eng.block_manager
    done: dict[str, object] = {}

    def cancel(e, step):
        if step == 6:
            victim = e.abort("r", index=2)
            done["victim"] = victim
            live = {b for s in seq.samples if not s.is_finished for b in s.block_table}
            assert bm.used_block_ids == live      # exactly its own blocks went back
            assert "r" in e.requests              # the request goes on
            assert e.abort("r", index=2) is None  # already ended

    _run(eng, cancel)
    victim = done["victim"]
    assert victim.index == 2 and victim.finish_reason is FinishReason.CANCELLED
    ref = _reference(prompt, SEEDED)
    for s in seq.samples:
        if s.index != 2:
            assert s.completion_token_ids == ref[s.index]
    assert len(victim.completion_token_ids) < SEEDED.max_tokens
    assert victim.completion_token_ids == ref[2][:len(victim.completion_token_ids)]
    assert bm.is_whole() and not eng.requests


def test_cancel_the_request_ends_every_sample():
    eng = _engine()
    other = eng.add_request(_prompt(20, salt=1), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    seq = eng.add_request(_prompt(41), SEEDED, request_id="r")
    for _ in range(5):
        eng.step()
    assert len(seq.samples) == 4
    eng.abort("r")
    assert all(s.finish_reason is FinishReason.CANCELLED for s in seq.samples)
    assert eng.block_manager.used_block_ids == set(other.block_table)
    _run(eng)
    assert eng.block_manager.is_whole() and not eng.requests


def test_preempted_samples_recompute_and_still_equal_separate_requests():
    prompt = _prompt(41)
    params = SamplingParams(n=4, seed=3, temperature=0.8, max_tokens=60, ignore_eos=True)
    eng = _engine(num_kv_blocks=12)          # 4 samples of 101 tokens would need 4 x 7 blocks
    seq = eng.add_request(prompt, params, request_id="r")
    _run(eng)
    assert eng.scheduler.num_preemptions > 0
    assert [s.completion_token_ids for s in seq.samples] == _reference(prompt, params)
    assert eng.block_manager.is_whole() and not eng.requests


@pytest.mark.parametrize("chunked", [True, False])
def test_overlapped_steps_fork_the_same(chunked):
    prompt = _prompt(41)
    kw = {"enable_chunked_prefill": chunked, "max_num_batched_tokens": 64 if chunked else 256}
    ref = _engine(**kw)
    want = ref.add_request(prompt, SEEDED)
    _run(ref)
    eng = _engine(async_scheduling=True, **kw)
    seq = eng.add_request(prompt, SEEDED)
    prefill, _ = _run(eng)
    assert prefill == len(prompt)
    assert [s.completion_token_ids for s in seq.samples] == [s.completion_token_ids for s in want.samples]
    assert eng.block_manager.is_whole()


def test_first_token_that_ends_sample_zero_still_forks():
    eng = _engine()
    seq = eng.add_request(_prompt(30), SamplingParams(n=3, seed=1, max_tokens=1), request_id="r")
    _run(eng)
    assert [len(s.completion_token_ids) for s in seq.samples] == [1, 1, 1]
    assert eng.block_manager.is_whole() and not eng.requests


def test_n_is_checked():
    eng = _engine()
    with pytest.raises(ValueError, match="n: must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n: 9 samples are more than max_num_seqs"):
        eng.validate(_prompt(4), SamplingParams(n=9))


def test_imported_kv_forks_on_the_decode_side():
    """Disaggregated: a prefill-only engine computes the prompt once (sample 0's first token);
    its blocks are copied into the decode engine's reservation, which forks on admit."""
    prompt = _prompt(41)
    local = _engine()
    want = local.add_request(prompt, SEEDED)
    _run(local)
    pre, dec = _engine(), _engine()
    held = pre.add_request(prompt, SEEDED, request_id="r", prefill_only=True)
    prefill, _ = _run(pre)
    assert prefill == len(prompt) and len(held.samples) == 1 and not held.fork_block_ids
    seq = dec.kv_handoff.reserve(prompt, SEEDED, "r")
    assert len(seq.fork_block_ids) == 3
    assert dec.block_manager.num_used_blocks == 3 + 3
    kv_src, kv_dst = pre.model_runner.kv_cache, dec.model_runner.kv_cache
    kv_dst[seq.block_table] = kv_src[held.block_table]           # the transfer
    pre.kv_handoff.release(held)
    assert pre.block_manager.is_whole()
    assert dec.kv_handoff.admit(seq, held.completion_token_ids[0], None)
    assert len(seq.samples) == 4
    prefill, _ = _run(dec)
    assert prefill == 0                                          # the decode side prefills nothing
    assert [s.completion_token_ids for s in seq.samples] == [s.completion_token_ids for s in want.samples]
    assert dec.block_manager.is_whole() and not dec.requests


def test_offline_generate_returns_every_sample():
    llm = LLM("tiny-qwen3", device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64, max_model_len=256)
    out, = llm.generate([_prompt(20)], SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [s.index for s in (out, *out.samples)] == [0, 1, 2]
    one = llm.generate([_prompt(20)], SamplingParams(seed=7, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.samples[1].token_ids == one.token_ids          # sample 2 = a request seeded 5 + 2
    assert llm.engine.block_manager.is_whole()


def test_the_batch_counts_the_samples_a_request_will_still_fork_into():
    # max_num_seqs 4: an n=4 request still prefilling owes 3 rows, so a request arriving meanwhile
    # waits; no step ever runs more than 4 rows, and both requests finish with the pool whole
    eng = LLM("tiny-qwen3", device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64, max_model_len=256,
              max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=16).engine
    first = eng.add_request(_prompt(41), SamplingParams(n=4, max_tokens=6, ignore_eos=True))
    eng.step()                                          # first chunk of 16: admitted, not forked
    late = eng.add_request(_prompt(9, salt=1), SamplingParams(max_tokens=6, ignore_eos=True))
    most = 0

    def watch(e, _steps):
        nonlocal most
        most = max(most, len(e.scheduler.running))
        assert late.num_completion_tokens == 0 or first.forked

    _run(eng, watch)
    assert most <= 4 and late.num_completion_tokens == 6 and first.num_completion_tokens == 6
    assert eng.block_manager.is_whole()


def test_a_seed_at_the_top_of_uint64_wraps_for_the_next_samples():
    params = SamplingParams(n=3, seed=2**64 - 1, temperature=0.7, max_tokens=4)
    assert [params.for_sample(i).seed for i in range(3)] == [2**64 - 1, 0, 1]
    eng = _engine()
    eng.add_request(_prompt(5), params)
    _run(eng)                                           # each sample's generator takes its seed
    assert eng.block_manager.is_whole()
