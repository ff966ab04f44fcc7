"""Guided decoding in the engine, on the embedded model (CPU): JSON Schema, json_object, regex
and choice outputs obey their grammar, greedy and sampled; the grammar state survives a
preemption (recompute) and the KV handoff between a prefill engine and a decode engine; bad
guides are refused naming the field; pools are whole afterwards."""
from __future__ import annotations

import json
import re

import pytest

from pdserve.common.engine import LLM
from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import Guide, InvalidParameter, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                         "sure": {"type": "boolean"}}}
JSON_GUIDE = Guide("json_schema", json.dumps(SCHEMA))
QUESTIONS = ["Is Paris the capital of France?", "Is the sun cold?", "Can fish fly?", "Is water wet?"]


@pytest.fixture(scope="module")
def llm():
    return LLM("default", device="cpu", num_kv_blocks=256)


def chat(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text + " Answer in JSON."}])


def check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"answer", "sure"} and obj["answer"] in ("yes", "no", "maybe")
    assert isinstance(obj["sure"], bool)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    prompts = [chat(llm, q) for q in QUESTIONS]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=40, guide=JSON_GUIDE)
              for i in range(len(prompts))]
    for out in llm.generate(prompts, params, use_tqdm=False):
        assert out.finish_reason == "stop", out.text
        check_schema(out.text)
    assert llm.engine.block_manager.is_whole()


def test_regex_choice_and_json_object(llm):
    prompt = chat(llm, "Write a code.")
    outs = llm.generate([prompt] * 4, [
        SamplingParams(temperature=0.0, max_tokens=20, guide=Guide("regex", r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, guide=Guide("choice", choices=("red", "green", "b.u+"))),
        SamplingParams(temperature=0.0, max_tokens=20, guide=Guide("grammar", 'root ::= "A" ("B" | "C")')),
        SamplingParams(temperature=0.0, max_tokens=60, guide=Guide("json_object"))], use_tqdm=False)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text)
    assert outs[1].text in ("red", "green", "b.u+")
    assert outs[2].text in ("AB", "AC")
    if outs[3].finish_reason == "stop":     # the tiny model may ramble past 60 tokens
        assert isinstance(json.loads(outs[3].text), dict)
    else:
        assert outs[3].text.lstrip().startswith("{")


def test_unguided_requests_beside_guided_ones_are_unchanged(llm):
    prompt = chat(llm, QUESTIONS[0])
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate([prompt], plain, use_tqdm=False)[0].token_ids
    mixed = llm.generate([prompt, prompt], [plain, SamplingParams(temperature=0.0, max_tokens=12, guide=JSON_GUIDE)],
                         use_tqdm=False)
    assert mixed[0].token_ids == alone
    check_schema_prefix = mixed[1].text.lstrip()
    assert check_schema_prefix.startswith("{")


def test_guide_survives_preemption():
    """A pool too small for every guided sequence at once: some are preempted and recomputed,
    their grammar state kept, and each output is the one it gets alone."""
    small = LLM("default", device="cpu", num_kv_blocks=8, block_size=16, enable_chunked_prefill=False)
    prompts = [chat(small, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=40, guide=JSON_GUIDE)
    alone = [small.generate([p], params, use_tqdm=False)[0] for p in prompts]
    together = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for out in together:
        check_schema(out.text)
    assert small.engine.block_manager.is_whole()


def test_guide_survives_the_kv_handoff(llm):
    """Prefill engine samples the first token under the grammar (prefill-only); the decode engine
    reserves, receives the KV blocks and the first token, and continues the grammar: the same
    tokens as one engine."""
    decode = LLM("default", device="cpu", num_kv_blocks=256)
    prompt = chat(llm, QUESTIONS[1])
    params = SamplingParams(temperature=0.0, max_tokens=40, guide=JSON_GUIDE)
    expected = llm.generate([prompt], params, use_tqdm=False)[0].token_ids

    src = llm.engine.add_request(prompt, params, request_id="h", prefill_only=True)
    while llm.engine.has_unfinished():
        llm.engine.step()
    dst = decode.engine.kv_handoff.reserve(prompt, params, "h")
    n = dst.num_cached_tokens // 16
    decode.engine.model_runner.kv_cache[dst.block_table[n:]] = llm.engine.model_runner.kv_cache[src.block_table[n:]]
    assert decode.engine.kv_handoff.admit(dst, src.last_token, None)
    llm.engine.kv_handoff.release(src)
    while decode.engine.has_unfinished():
        decode.engine.step()
    assert dst.completion_token_ids == expected and dst.finish_reason is FinishReason.STOP
    assert llm.engine.block_manager.is_whole() and decode.engine.block_manager.is_whole()


def test_a_first_token_the_grammar_refuses_ends_the_request_with_an_error(llm):
    prompt = chat(llm, QUESTIONS[2])
    params = SamplingParams(temperature=0.0, max_tokens=10, guide=Guide("choice", choices=("yes", "no")))
    seq = llm.engine.kv_handoff.reserve(prompt, params, "refused")
    bad = llm.tokenizer.encode("{")[0]
    assert not llm.engine.kv_handoff.admit(seq, bad, None)
    assert seq.finish_reason is FinishReason.ERROR
    assert llm.engine.block_manager.is_whole()


@pytest.mark.parametrize("guide, field", [
    (Guide("json_schema", "{not json"), "guide.json_schema"),
    (Guide("json_schema", "[1, 2]"), "guide.json_schema"),
    (Guide("regex", "(unclosed"), "guide.regex"),
    (Guide("grammar", "root ::= undefined_rule"), "guide.grammar"),
])
def test_bad_guides_name_the_field_and_leave_nothing(llm, guide, field):
    with pytest.raises(InvalidParameter) as e:
        llm.engine.add_request([1, 2, 3], SamplingParams(guide=guide), request_id="bad")
    assert e.value.field == field
    assert "bad" not in llm.engine.requests and llm.engine.block_manager.is_whole()


@pytest.mark.parametrize("kwargs, field", [
    ({"kind": "xml"}, "guide"), ({"kind": "regex"}, "guide.regex"),
    ({"kind": "choice"}, "guide.choice"), ({"kind": "choice", "choices": ("a", "")}, "guide.choice")])
def test_malformed_guides_are_refused_on_construction(kwargs, field):
    with pytest.raises(InvalidParameter) as e:
        Guide(**kwargs)
    assert e.value.field == field


def test_overlapped_steps_give_the_same_guided_tokens(llm):
    """With async scheduling a guided sequence's step is launched before its last token is read,
    its sampling deferred until that token is accepted (its mask needs it): the same tokens as
    without overlap, beside an unguided neighbour (tests/unit/test_guided_overlap.py has more)."""
    overlapped = LLM("default", device="cpu", num_kv_blocks=256, async_scheduling=True)
    prompts = [chat(llm, q) for q in QUESTIONS[:2]]
    params = [SamplingParams(temperature=0.0, max_tokens=30, guide=JSON_GUIDE), SamplingParams(temperature=0.0,
                                                                                               max_tokens=30)]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = overlapped.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    check_schema(b[0].text)
    assert overlapped.engine.block_manager.is_whole()
