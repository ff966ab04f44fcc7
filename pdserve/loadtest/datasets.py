"""Serving workloads: lists of :class:`BenchRequest`, deterministic for a seed.

``random`` (uniform lengths), ``w-nano`` (docs/design.md's W-nano: 256 prompts of 100-1024
random ids, 100-1024 output tokens, temperature 0.6, ignore_eos, ``random.seed(0)``),
``shared-prefix``, ``multi-turn``, ``prefill-heavy``, ``decode-heavy`` and ``jsonl`` (a file).
Synthetic prompts are token ids, or with ``prompt_format="text"`` English words of about one
token each (the router's ``usage.prompt_tokens`` gives the real count). The ``phases`` workload
(pdserve/loadtest/phases.py) strings three of these together with arrival times of its own.

``variant`` k > 0 draws the same workload with other prompts: every request keeps its lengths,
its shared system prompt (``shared-prefix``, ``multi-turn``) and its place in its conversation,
and the rest of its token ids are shifted by ``k * VARIANT_STRIDE`` modulo the vocabulary. A
benchmark runs each point of a sweep on its own variant, so a point never finds the previous
point's prompts in the workers' prefix caches (``jsonl`` files are used as they are).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DATASETS = ("random", "w-nano", "shared-prefix", "multi-turn", "prefill-heavy", "decode-heavy", "jsonl")
PROMPT_FORMATS = ("ids", "text")
VARIANT_STRIDE = 7919           # a prime: variants 1, 2, ... shift every id by a different amount

# Per-dataset defaults: (input range, output range, number of prompts).
DEFAULTS: dict[str, dict[str, Any]] = {
    "random": {"input_len": (128, 1024), "output_len": (64, 256), "num_prompts": 200},
    "shared-prefix": {"input_len": (32, 64), "output_len": (64, 128), "num_prompts": 200},
    "multi-turn": {"input_len": (64, 128), "output_len": (64, 128), "num_prompts": 200},
    "prefill-heavy": {"input_len": (1792, 2304), "output_len": (16, 64), "num_prompts": 200},
    "decode-heavy": {"input_len": (64, 128), "output_len": (512, 512), "num_prompts": 200},
    "w-nano": {"num_prompts": 256},
    "jsonl": {"output_len": (128, 128), "num_prompts": None},
}
# Words that are single tokens with a leading space in GPT-2-style BPE vocabularies.
_WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be or "
          "has had not but first one their its new after who they have her she two been other when "
          "there all during into school time may years more most only over city some world would "
          "where later up such used many can state about national out known university united then "
          "made").split()


@dataclass
class BenchRequest:
    """One request of a workload. Exactly one of ``token_ids``, ``text``, ``messages`` is set."""

    prompt_len: int                          # tokens (exact for ids, estimated for text/messages)
    output_len: int                          # max_tokens
    token_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. {"prefix": 3}
    after: int = -1                          # index of the request that must end before this one is sent

    def to_proto(self, request_id: str = ""):
        """The ``pdserve.v1.GenerateRequest`` for this request."""
        from pdserve.v1 import common_pb2, router_pb2
        params = common_pb2.SamplingParams(temperature=self.temperature, max_tokens=self.output_len,
                                           ignore_eos=self.ignore_eos)
        req = router_pb2.GenerateRequest(request_id=request_id, params=params)
        if self.token_ids is not None:
            req.token_ids.ids.extend(self.token_ids)
        elif self.messages is not None:
            req.chat.messages.extend(router_pb2.ChatMessage(role=m.get("role", "user"), content=m.get("content", ""))
                                     for m in self.messages)
        else:
            req.text = self.text or ""
        return req


RangeArg = str | int | tuple[int, int] | None   # what parse_range accepts


def parse_range(value: RangeArg) -> tuple[int, int] | None:
    """``"512"`` -> (512, 512); ``"100:1024"`` or ``"100-1024"`` -> (100, 1024) (inclusive)."""
    if value is None or isinstance(value, tuple):
        return value
    if isinstance(value, int):
        return (value, value)
    s = str(value).strip()
    for sep in (":", "-", ","):
        if sep in s:
            lo, hi = (int(x) for x in s.split(sep, 1))
            break
    else:
        lo = hi = int(s)
    if lo < 0 or hi < lo:
        raise ValueError(f"bad length range {value!r}: need 0 <= lo <= hi")
    return (lo, hi)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def vary(requests: list[BenchRequest], variant: int, vocab: int, shared: int = 0) -> list[BenchRequest]:
    """The ``variant``-th other draw of ``requests`` (module docstring): ids after the first
    ``shared`` of each prompt shifted by ``variant * VARIANT_STRIDE`` modulo ``vocab``."""
    shift = variant * VARIANT_STRIDE % vocab
    return [replace(r, token_ids=r.token_ids[:shared] + [(t + shift) % vocab for t in r.token_ids[shared:]])
            if r.token_ids is not None else r for r in requests]


W_NANO_VOCAB = 10001            # W-nano's ids are drawn from 0..10000


def w_nano(num_prompts: int = 256) -> list[BenchRequest]:
    """docs/design.md W-nano exactly (the same draws as bench/workloads.py, from Random(0))."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, W_NANO_VOCAB - 1) for _ in range(rng.randint(100, 1024))] for _ in range(num_prompts)]
    return [BenchRequest(len(p), rng.randint(100, 1024), token_ids=p, temperature=0.6, ignore_eos=True)
            for p in prompts]


def random_lengths(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                   seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        out.append(BenchRequest(n_in, max(1, n_out), token_ids=_ids(rng, n_in, vocab)))
    return out


def shared_prefix(num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: tuple[int, int],
                  output_len: tuple[int, int], vocab: int, seed: int) -> list[BenchRequest]:
    """``num_prefixes`` system prompts of ``prefix_len`` tokens; request i uses prefix i % N plus
    its own suffix; the order is shuffled (seeded) so prefixes interleave in time."""
    if num_prefixes < 1:
        raise ValueError("num_prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        k = i % num_prefixes
        suffix = _ids(rng, rng.randint(*suffix_len), vocab)
        ids = prefixes[k] + suffix
        out.append(BenchRequest(len(ids), max(1, rng.randint(*output_len)), token_ids=ids, extra={"prefix": k}))
    rng.shuffle(out)
    return out


def multi_turn(num_prompts: int, num_turns: int, num_prefixes: int, prefix_len: int, user_len: tuple[int, int],
               output_len: tuple[int, int], vocab: int, seed: int, active: int = 16) -> list[BenchRequest]:
    """Chat conversations of ``num_turns`` turns, cut to ``num_prompts`` requests: turn 1 = a system
    prompt (one of ``num_prefixes``) + a user message; turn k+1 = turn k's prompt + a synthetic
    reply + a new user message. ``active`` conversations run at a time, turn by turn.
    ``extra``: conversation, turn."""
    if num_turns < 1 or num_prefixes < 1 or active < 1:
        raise ValueError("num_turns, num_prefixes and active must be >= 1")
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)] if prefix_len else [[]]
    n_conv = -(-num_prompts // num_turns)
    convs: list[list[BenchRequest]] = []
    for c in range(n_conv):
        prompt = list(prefixes[c % len(prefixes)])
        turns = []
        for t in range(num_turns):
            prompt = prompt + _ids(rng, rng.randint(*user_len), vocab)
            out_len = max(1, rng.randint(*output_len))
            turns.append(BenchRequest(len(prompt), out_len, token_ids=list(prompt),
                                      extra={"conversation": c, "turn": t}))
            prompt = prompt + _ids(rng, out_len, vocab)
        convs.append(turns)
    out: list[BenchRequest] = []
    for g in range(0, n_conv, active):
        group = convs[g:g + active]
        for t in range(num_turns):
            layer = [turns[t] for turns in group]
            rng.shuffle(layer)
            out.extend(layer)
    return out[:num_prompts]


def closed_loop(requests: list[BenchRequest]) -> list[BenchRequest]:
    """A multi-turn workload where each turn waits for its conversation's previous turn to end
    (``after``), as a chat user waits for the answer before writing the next message."""
    last: dict[Any, int] = {}
    out = []
    for i, r in enumerate(requests):
        conv = r.extra.get("conversation")
        if conv is None:
            raise ValueError("closed-loop turns need a multi-turn workload (requests of conversations)")
        out.append(replace(r, after=last.get(conv, -1)))
        last[conv] = i
    return out


def load_jsonl(path: str | Path, num_prompts: int | None, default_output_len: int, seed: int,
               shuffle: bool = False) -> list[BenchRequest]:
    """A JSONL file: ``prompt`` (text), ``messages`` (chat) or ``token_ids`` per line, with an
    optional ``max_tokens`` (else ``default_output_len``). Lines are reused in order when
    ``num_prompts`` exceeds them. Prompt lengths of text are estimated (4 characters a token)."""
    rows: list[BenchRequest] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
        max_tokens = int(d.get("max_tokens") or d.get("output_len") or default_output_len)
        if "token_ids" in d or "prompt_token_ids" in d:
            ids = [int(x) for x in d.get("token_ids", d.get("prompt_token_ids"))]
            rows.append(BenchRequest(len(ids), max_tokens, token_ids=ids, ignore_eos=False))
        elif "messages" in d:
            msgs = [{"role": str(m.get("role", "user")), "content": str(m.get("content", ""))} for m in d["messages"]]
            est = sum(len(m["content"]) for m in msgs) // 4 + 4 * len(msgs)
            rows.append(BenchRequest(est, max_tokens, messages=msgs, ignore_eos=False))
        elif "prompt" in d:
            text = str(d["prompt"])
            rows.append(BenchRequest(max(1, len(text) // 4), max_tokens, text=text, ignore_eos=False))
        else:
            raise ValueError(f"{path}:{lineno}: needs 'prompt', 'messages' or 'token_ids'")
    if not rows:
        raise ValueError(f"{path}: no requests")
    if shuffle:
        random.Random(seed).shuffle(rows)
    n = len(rows) if num_prompts is None else num_prompts
    return [replace(rows[i % len(rows)]) for i in range(n)]


def to_text(requests: list[BenchRequest]) -> list[BenchRequest]:
    """Token-id prompts -> text prompts of about as many tokens (one common word per id)."""
    out = []
    for r in requests:
        if r.token_ids is None:
            out.append(r)
            continue
        words = [_WORDS[t % len(_WORDS)] for t in r.token_ids]   # shared id prefixes stay shared
        out.append(replace(r, token_ids=None, text=" ".join(words)))
    return out


def _need_range(r: tuple[int, int] | None, what: str, dataset: str) -> tuple[int, int]:
    if r is None:
        raise ValueError(f"the {dataset} dataset has no default {what}; pass one")
    return r


def build(name: str, *, num_prompts: int | None = None, input_len: RangeArg = None, output_len: RangeArg = None,
          vocab: int = 10000,
          seed: int = 0, prompt_format: str = "ids", dataset_path: str | None = None, num_prefixes: int = 8,
          prefix_len: int = 1024, temperature: float | None = None, ignore_eos: bool | None = None,
          max_model_len: int | None = None, num_turns: int = 4, variant: int = 0) -> list[BenchRequest]:
    """Build a workload by name; ``input_len``/``output_len`` ranges override the dataset's
    defaults (``shared-prefix``: ``input_len`` is the suffix), as do ``temperature``/``ignore_eos``;
    ``variant``: see the module docstring."""
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, not {name!r}")
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}")
    d = DEFAULTS[name]
    n = num_prompts if num_prompts is not None else d["num_prompts"]
    in_r = parse_range(input_len) or d.get("input_len")
    out_r = parse_range(output_len) or d.get("output_len")
    if name == "w-nano":
        reqs = w_nano(n)
    elif name == "jsonl":
        if not dataset_path:
            raise ValueError("the jsonl dataset needs --dataset-path")
        reqs = load_jsonl(dataset_path, n, _need_range(out_r, "output_len", name)[1], seed)
    elif name == "shared-prefix":
        reqs = shared_prefix(n, num_prefixes, prefix_len, _need_range(in_r, "input_len", name),
                             _need_range(out_r, "output_len", name), vocab, seed)
    elif name == "multi-turn":
        reqs = multi_turn(n, num_turns, num_prefixes, prefix_len, _need_range(in_r, "input_len", name),
                          _need_range(out_r, "output_len", name), vocab, seed)
    else:
        reqs = random_lengths(n, _need_range(in_r, "input_len", name), _need_range(out_r, "output_len", name),
                              vocab, seed)
    if variant and name != "jsonl":
        shared = prefix_len if name in ("shared-prefix", "multi-turn") else 0
        reqs = vary(reqs, variant, vocab if name != "w-nano" else W_NANO_VOCAB, shared)
    if temperature is not None:
        reqs = [replace(r, temperature=temperature) for r in reqs]
    if ignore_eos is not None:
        reqs = [replace(r, ignore_eos=ignore_eos) for r in reqs]
    if max_model_len:
        too_long = sum(1 for r in reqs if r.token_ids is not None and r.prompt_len + r.output_len > max_model_len)
        if too_long:
            raise ValueError(f"{too_long} of {len(reqs)} requests exceed the model's context of {max_model_len} "
                             "tokens (prompt + max_tokens): choose shorter lengths")
    if prompt_format == "text":
        reqs = to_text(reqs)
    return reqs


def summary(requests: list[BenchRequest]) -> dict[str, Any]:
    return {"num_prompts": len(requests),
            "total_prompt_tokens": sum(r.prompt_len for r in requests),
            "total_max_tokens": sum(r.output_len for r in requests),
            "prompt_len_min": min((r.prompt_len for r in requests), default=0),
            "prompt_len_max": max((r.prompt_len for r in requests), default=0),
            "output_len_min": min((r.output_len for r in requests), default=0),
            "output_len_max": max((r.output_len for r in requests), default=0)}
