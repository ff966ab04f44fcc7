"""Guided sequences take the overlapped step path (engine/overlap.py), on the embedded model
(CPU): step N+1's forward is launched before step N's tokens are read, its sampling deferred
until they are accepted into the grammars and its mask filled. Nothing a caller sees changes:
the same tokens and finish reasons as without overlap (greedy and seeded; JSON Schema, regex and
choice guides; mixed batches of guided and unguided sequences finishing at different steps;
sequences arriving while others decode, with and without chunked prefill, prefill-only ones
included); every output obeys its grammar and the pools are whole."""
from __future__ import annotations

import json
import re

import pytest

from pdserve.common.engine import LLM
from pdserve.common.sampling_params import Guide, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                         "sure": {"type": "boolean"}}}
JSON_GUIDE = Guide("json_schema", json.dumps(SCHEMA))
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ("red", "green", "b.u+")
QUESTIONS = ["Is Paris the capital of France?", "Is the sun cold?", "Can fish fly?", "Is water wet?"]


def engines(**kwargs) -> tuple[LLM, LLM]:
    """The same engine without and with overlapped steps."""
    return (LLM("default", device="cpu", num_kv_blocks=256, async_scheduling=False, **kwargs),
            LLM("default", device="cpu", num_kv_blocks=256, async_scheduling=True, **kwargs))


def count_deferred(llm: LLM) -> list[int]:
    """Counts the steps launched with their sampling deferred (guided rows overlapped)."""
    runner, count = llm.engine.model_runner, [0]
    launch = runner.launch

    def counting(*args, **kwargs):
        launched = launch(*args, **kwargs)
        count[0] += not launched.sampled
        return launched

    runner.launch = counting    # type: ignore[method-assign]
    return count


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text + " Answer in JSON."}])


def requests(llm: LLM) -> list[tuple[list[int], SamplingParams]]:
    """Guided and unguided requests, greedy and seeded, that end at different steps."""
    q = [chat(llm, text) for text in QUESTIONS]
    return [
        (q[0], SamplingParams(temperature=0.0, max_tokens=40, guide=JSON_GUIDE)),
        (q[1], SamplingParams(temperature=0.9, seed=7, max_tokens=40, guide=JSON_GUIDE)),
        (q[2], SamplingParams(temperature=0.0, max_tokens=20, guide=Guide("regex", REGEX))),
        (q[3], SamplingParams(temperature=1.0, seed=3, max_tokens=20, guide=Guide("choice", choices=CHOICES))),
        (q[0], SamplingParams(temperature=0.0, max_tokens=9)),
        (q[1], SamplingParams(temperature=1.0, seed=11, max_tokens=25, ignore_eos=True)),
        (q[2], SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True,
                              guide=Guide("choice", choices=("yes", "no")))),
    ]


def check_valid(text: str, guide: Guide | None) -> None:
    """``text`` is a complete output of ``guide``."""
    if guide is None:
        return
    if guide.kind == "json_schema":
        obj = json.loads(text)
        assert set(obj) == {"answer", "sure"} and obj["answer"] in ("yes", "no", "maybe")
    elif guide.kind == "regex":
        assert re.fullmatch(guide.value, text), text
    else:
        assert text in guide.choices


def test_a_mixed_batch_gives_the_same_tokens_with_overlap():
    plain, overlapped = engines()
    deferred = count_deferred(overlapped)
    prompts, params = zip(*requests(plain))
    a = plain.generate(list(prompts), list(params), use_tqdm=False)
    b = overlapped.generate(list(prompts), list(params), use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in b] == [(o.token_ids, o.finish_reason) for o in a]
    assert len({len(o.token_ids) for o in b}) >= 4           # they finished at different steps
    for out, p in zip(b, params):
        if p.guide is not None:
            assert out.finish_reason == "stop", out.text  # the grammar ended it, ignore_eos or not
        check_valid(out.text, p.guide)
    assert deferred[0] >= 10                              # guided rows did take the overlapped path
    for llm in (plain, overlapped):
        assert llm.engine.block_manager.is_whole() and llm.engine.pending is None


def run_arrivals(llm: LLM, arrivals: list[tuple[int, str, list[int], SamplingParams, bool]]
                 ) -> tuple[dict[str, tuple[list[int], str | None]], dict[str, list[int]]]:
    """Requests added at their step while others decode; (tokens, finish reason) by id, and the
    tokens of the prefill-only ones (held, then released)."""
    eng = llm.engine
    launched_unsampled = []
    eng.on_prefill_launch = lambda seqs, launched: launched_unsampled.append(not launched.sampled)
    results, held, step, pending = {}, {}, 0, sorted(arrivals, key=lambda a: a[0])
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, prefill_only = pending.pop(0)
            eng.add_request(prompt, params, request_id=rid, prefill_only=prefill_only)
        for seq in eng.step().finished:
            if seq.request_id in eng.kv_handoff.held:
                held[seq.request_id] = seq.completion_token_ids
            else:
                reason = seq.finish_reason.value if seq.finish_reason else None
                results[seq.request_id] = (seq.completion_token_ids, reason)
        step += 1
        assert step < 2000
    for seq in list(eng.kv_handoff.held.values()):
        eng.kv_handoff.release(seq)
    assert not any(launched_unsampled)         # a KV sender is told of a step once it samples
    assert eng.block_manager.is_whole() and eng.pending is None
    return results, held


@pytest.mark.parametrize("chunking", [
    dict(enable_chunked_prefill=False),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8)])
def test_arrivals_while_guided_rows_decode_give_the_same_tokens(chunking):
    plain, overlapped = engines(**chunking)
    deferred = count_deferred(overlapped)
    reqs = requests(plain)
    arrivals = [(3 * i, f"r{i}", prompt, params, False) for i, (prompt, params) in enumerate(reqs)]
    arrivals.append((5, "held", reqs[0][0], SamplingParams(temperature=0.0, max_tokens=40, guide=JSON_GUIDE), True))
    a, a_held = run_arrivals(plain, arrivals)
    b, b_held = run_arrivals(overlapped, arrivals)
    assert b == a and b_held == a_held and len(b_held["held"]) == 1
    tok = plain.tokenizer
    for i, (_, params) in enumerate(reqs):
        tokens, reason = b[f"r{i}"]
        if params.guide is not None:
            assert reason == "stop"
            check_valid(tok.decode(tokens, skip_special_tokens=True), params.guide)
    assert deferred[0] >= 10
