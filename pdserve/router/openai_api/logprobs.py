"""OpenAI ``logprobs`` objects from token ids and their log-probabilities (pure functions).

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}]}``. Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
where each ``top_logprobs`` entry is a dict token -> logprob of the position's most likely tokens
plus the chosen one (as vLLM returns it), or None when none were asked. With ``echo`` the prompt
comes first: its first token has no logprob (None) and no top dict.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.common.outputs import TopLogprobs

Decode = Callable[[list[int]], list[str]]    # token ids -> one string per id


def chat_logprobs(decode: Decode, ids: list[int], lps: list[float], tops: Sequence[TopLogprobs]) -> dict:
    """The chat shape for generated tokens ``ids`` (``tops``: one entry per token, or empty)."""
    tokens = decode(ids)
    content = []
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        alts = []
        if i < len(tops):
            top_ids, top_lps = tops[i]
            alts = [{"token": s, "logprob": v, "bytes": list(s.encode())}
                    for s, v in zip(decode(top_ids), top_lps)]
        content.append({"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": alts})
    return {"content": content}


def completion_logprobs(decode: Decode, ids: list[int], lps: Sequence[float | None], offset: int,
                        tops: Sequence[TopLogprobs | None] | None) -> dict:
    """The completions shape; ``lps`` / ``tops`` per token of ``ids`` (None entries: an echoed
    first prompt token); ``tops`` None: top_logprobs was 0; ``offset``: the text offset of the
    first token."""
    tokens = decode(ids)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top_dicts = None
    if tops is not None:
        top_dicts = [None if top is None else _top_dict(decode, tok, lp, top)
                     for tok, lp, top in zip(tokens, lps, tops)]
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top_dicts, "text_offset": offsets}


def echo_logprobs(decode: Decode, prompt_ids: list[int], prompt_lps: list[float],
                  prompt_tops: list[TopLogprobs], ids: list[int], lps: list[float],
                  tops: list[TopLogprobs], k: int) -> dict:
    """The completions shape of an echoed prompt followed by the generated tokens (``k``: the
    request's top_logprobs; prompt values for tokens 1..n-1 of the prompt)."""
    all_lps: list[float | None] = [None, *prompt_lps, *lps]
    all_tops: list[TopLogprobs | None] | None = [None, *prompt_tops, *tops] if k else None
    return completion_logprobs(decode, prompt_ids + ids, all_lps, 0, all_tops)


def _top_dict(decode: Decode, token: str, lp: float | None, top: TopLogprobs) -> dict[str, float]:
    out: dict[str, float] = {}
    for s, v in zip(decode(top[0]), top[1]):
        out.setdefault(s, v)          # two ids of one string: the likelier one's value
    if lp is not None and token not in out:
        out[token] = lp
    return out
