"""Router pieces without a network: stop strings / detokenization, sampling validation, prompts."""
from __future__ import annotations

import pytest

from pdserve.common.grpc_utils import InvalidArgument  # noqa: E402
from pdserve.common.grpc_utils.convert import sampling_params_to_proto  # noqa: E402
from pdserve.common.outputs import FinishReason, SequenceOutput  # noqa: E402
from pdserve.router.flow import Flow  # noqa: E402
from pdserve.router.output import OutputProcessor, TextOutput  # noqa: E402
from pdserve.router.servicer import generate_response  # noqa: E402
from pdserve.router.tokenization import build_prompt, check_context, resolve_spec  # noqa: E402
from pdserve.router.validation import from_proto  # noqa: E402
from pdserve.router.workers import parse_addresses, split_dns_target  # noqa: E402
from pdserve.v1 import common_pb2, router_pb2  # noqa: E402


class CharTokenizer:
    """Token id = code point; decode joins characters (ids >= 1000 are 'special')."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i >= 1000))


def _respond(steps: list[SequenceOutput], stop: tuple[str, ...] = (), logprobs: bool = False
             ) -> list[tuple[TextOutput, bool, bool]]:
    """Flow._respond over ``steps`` (what an attempt returns) for a 3-token prompt."""
    from types import SimpleNamespace
    flow = SimpleNamespace(metrics=SimpleNamespace(cached_tokens=SimpleNamespace(inc=lambda n: None)))
    job = SimpleNamespace(request_id="req", sampling=SimpleNamespace(logprobs=logprobs),
                          prompt=SimpleNamespace(token_ids=[1, 2, 3]))
    proc = OutputProcessor(CharTokenizer(), stop)
    answers = [Flow._respond(flow, job, proc, 2, step) for step in steps]   # type: ignore[arg-type]
    return [a for a in answers if a is not None]


def test_flow_outputs_carry_text_and_the_last_one_the_accounting() -> None:
    out = _respond([SequenceOutput("w-1", ids("ab"), [-1.0, -2.0]),
                    SequenceOutput("w-1", ids("c"), [-3.0], FinishReason.LENGTH)], logprobs=True)
    (first, done1, _), (last, done2, hit) = out
    assert (first.request_id, first.text, first.logprobs, first.finish_reason) == ("req", "ab", [-1.0, -2.0], None)
    assert not done1 and done2 and not hit
    assert last.finish_reason is FinishReason.LENGTH and last.matched_stop is None
    assert (last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) == (3, 3, 2)
    wire = generate_response(last)
    assert wire.finish_reason == common_pb2.FINISH_REASON_LENGTH and wire.text == "c"
    assert (wire.usage.prompt_tokens, wire.usage.completion_tokens, wire.usage.cached_tokens) == (3, 3, 2)
    mid = generate_response(first)
    assert mid.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not mid.HasField("usage")


def test_a_stop_string_ends_with_stop_and_is_stop_string_on_the_wire() -> None:
    ((last, done, hit),) = _respond([SequenceOutput("w-1", ids("xyEND"))], stop=("END",))
    assert done and hit and last.text == "xy" and not last.logprobs
    assert last.finish_reason is FinishReason.STOP and last.matched_stop == "END"
    wire = generate_response(last)
    assert wire.finish_reason == common_pb2.FINISH_REASON_STOP_STRING and wire.matched_stop == "END"


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def run(proc: OutputProcessor, steps: list[str]) -> tuple[str, str | None]:
    text = ""
    for s in steps:
        d = proc.add(ids(s))
        text += d.text
        if d.matched_stop:
            return text, d.matched_stop
    d = proc.finish()
    return text + d.text, d.matched_stop


def test_no_stop_streams_everything() -> None:
    assert run(OutputProcessor(CharTokenizer()), ["Hel", "lo", " world"]) == ("Hello world", None)


def test_stop_string_across_steps_is_never_sent() -> None:
    proc = OutputProcessor(CharTokenizer(), stop=["END"])
    sent = [proc.add(ids(s)).text for s in ["abc E", "N"]]
    assert sent == ["abc ", ""]                      # "E", then "EN" held back
    d = proc.add(ids("Dxyz"))
    assert d.text == "" and d.matched_stop == "END"
    assert proc.text == "abc "


def test_held_back_text_released_when_it_is_not_a_stop() -> None:
    proc = OutputProcessor(CharTokenizer(), stop=["END"])
    assert proc.add(ids("abE")).text == "ab"
    assert proc.add(ids("x")).text == "Ex"
    assert proc.finish().text == ""


def test_no_stop_string_before_min_tokens() -> None:
    proc = OutputProcessor(CharTokenizer(), stop=["END"], min_tokens=6)
    assert proc.add(ids("aEND")).text == "aEND"               # 4 tokens: not a stop yet
    assert proc.add(ids("bb")).text == "bb"
    d = proc.add(ids("cEND!"))
    assert d.text == "c" and d.matched_stop == "END"          # after 6 tokens it is


def test_include_stop_and_earliest_match_wins() -> None:
    proc = OutputProcessor(CharTokenizer(), stop=["cd", "b"], include_stop=True)
    text, matched = run(proc, ["abcd"])
    assert (text, matched) == ("ab", "b")


def test_stop_found_in_flushed_tail() -> None:
    proc = OutputProcessor(CharTokenizer(), stop=["xyz"])
    text, matched = run(proc, ["aaxy", "z"])
    assert (text, matched) == ("aa", "xyz")


def test_special_tokens_skipped_unless_kept() -> None:
    assert run(OutputProcessor(CharTokenizer()), ["a"])[0] == "a"
    proc = OutputProcessor(CharTokenizer(), skip_special_tokens=True)
    assert proc.add([ord("a"), 1001]).text == "a"


def test_without_tokenizer_only_tokens() -> None:
    proc = OutputProcessor(None)
    d = proc.add([5, 6], [-0.1, -0.2])
    assert d.token_ids == [5, 6] and d.logprobs == [-0.1, -0.2] and d.text == ""


@pytest.mark.parametrize("field,kwargs", [
    ("params.temperature", dict(temperature=-1.0)),
    ("params.top_p", dict(top_p=2.0)),
    ("params.top_p", dict(top_p=-0.5)),
    ("params.top_k", dict(top_k=-2)),
    ("params.min_p", dict(min_p=1.5)),
    ("params.repetition_penalty", dict(repetition_penalty=-1.0)),
    ("params.presence_penalty", dict(presence_penalty=3.0)),
    ("params.frequency_penalty", dict(frequency_penalty=-2.5)),
    ("params.temperature", dict(temperature=float("nan"))),
    ("params.stop_token_ids[1]", dict(stop_token_ids=[1, 600])),
    ("params.stop[0]", dict(stop=[""])),
])
def test_bad_sampling_names_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(InvalidArgument) as e:
        from_proto(common_pb2.SamplingParams(**kwargs), vocab_size=512, has_tokenizer=True)
    assert e.value.field == field and str(e.value).startswith(field)


def test_zero_means_default() -> None:
    rp = from_proto(common_pb2.SamplingParams(), vocab_size=512, has_tokenizer=False)
    s = rp.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.seed) == (0.0, 1.0, -1, 1.0, None)
    assert rp.max_tokens == 0
    wire = sampling_params_to_proto(s, max_tokens=7)
    assert wire.max_tokens == 7 and wire.top_p == 1.0 and wire.top_k == -1 and not wire.HasField("seed")
    seeded = from_proto(common_pb2.SamplingParams(seed=0), 512, False).sampling
    assert seeded.seed == 0 and sampling_params_to_proto(seeded, max_tokens=1).HasField("seed")
    with pytest.raises(InvalidArgument, match="params.stop"):
        from_proto(common_pb2.SamplingParams(stop=["x"]), 512, has_tokenizer=False)


def test_prompts_without_tokenizer() -> None:
    spec = resolve_spec("tiny-llama")
    assert spec.tokenizer_dir is None and spec.vocab_size == 512 and spec.max_model_len == 1024
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2, 3]))
    prompt = build_prompt(req, None, spec, spec.vocab_size)
    assert prompt.token_ids == [1, 2, 3]
    assert check_context(prompt, 0, 1024) == 1021
    cases = [
        (router_pb2.GenerateRequest(), "input"),
        (router_pb2.GenerateRequest(text="hello"), "text"),
        (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[])), "token_ids.ids"),
        (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 512])), "token_ids.ids[1]"),
    ]
    for request, field in cases:
        with pytest.raises(InvalidArgument) as e:
            build_prompt(request, None, spec, spec.vocab_size)
        assert e.value.field == field
    with pytest.raises(InvalidArgument) as e:
        check_context(prompt, 1022, 1024)
    assert e.value.field == "params.max_tokens"


def test_worker_addresses() -> None:
    assert parse_addresses(" a:1, ,dns:///b:2") == ["a:1", "dns:///b:2"]
    assert split_dns_target("a:1") is None
    assert split_dns_target("dns:///pods.ns.svc:50053") == ("pods.ns.svc", 50053)
    assert split_dns_target("dns://8.8.8.8/pods:1") == ("pods", 1)
    with pytest.raises(ValueError):
        split_dns_target("dns:///nopport")
