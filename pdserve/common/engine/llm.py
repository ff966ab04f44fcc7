"""The offline API: ``LLM(model).generate(prompts, sampling_params)``.

>>> from pdserve.common.engine import LLM, SamplingParams
>>> llm = LLM("default")
>>> llm.generate(["What is the capital of France?"], SamplingParams(temperature=0))[0].text
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from pdserve.common.config import EngineConfig
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sequence import PLACEHOLDER
from pdserve.common.sampling_params import InvalidParameter, SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)   # per token
    prompt_logprobs: list[float] = field(default_factory=list)      # prompt tokens 1..n-1
    prompt_top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    index: int = 0                 # the sample (SamplingParams.n)
    samples: list[RequestOutput] = field(default_factory=list)   # samples 1..n-1 (on sample 0's output)


class LLM:
    """In-process engine over a checkpoint dir, a preset, or ``"default"`` (the embedded model).

    Keyword arguments are EngineConfig fields (block_size, num_kv_blocks, device, dtype, ...).
    """

    def __init__(self, model: str = "default", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other ranks (tensor_parallel_size > 1; they also stop when this
        process exits). Nothing to do at one rank."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("prompt", "this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidParameter("messages", "this model has no chat template")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        All prompts are validated before any is queued, so a bad one leaves nothing allocated.
        """
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise InvalidParameter("sampling_params", f"{len(params)} given for {len(prompts)} prompts")
        token_lists = [self.encode(p) for p in prompts]
        for tokens, p in zip(token_lists, params):
            self.engine.validate(tokens, p)
        seqs = [self.engine.add_request(t, p) for t, p in zip(token_lists, params)]
        try:
            self._run(len(seqs), use_tqdm)
        except BaseException:
            for seq in seqs:
                self.engine.abort(seq.request_id)
            raise
        return [self._output(seq) for seq in seqs]     # n > 1: the other samples in .samples

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               skip_special_tokens: bool = True) -> Iterator[str]:
        """Generate for one prompt, yielding the text as each step completes it."""
        if self.tokenizer is None:
            raise InvalidParameter("prompt", "streaming text needs a tokenizer")
        seq = self.engine.add_request(self.encode(prompt), sampling_params or SamplingParams())
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens)
        seen = seq.num_completion_tokens
        try:
            while not seq.is_finished:
                self.engine.step()
                ids = seq.completion_token_ids
                known = len(ids) - (1 if ids and ids[-1] == PLACEHOLDER else 0)
                new, seen = ids[seen:known], known
                if new and (delta := detok.add(new)):
                    yield delta
            if tail := detok.flush():
                yield tail
        finally:
            self.engine.abort(seq.request_id)

    def _run(self, total: int, use_tqdm: bool) -> None:
        bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while self.engine.has_unfinished():
            if not use_tqdm:
                self.engine.step()
                continue
            start = time.perf_counter()
            out = self.engine.step()
            elapsed = max(time.perf_counter() - start, 1e-9)
            if out.is_prefill:
                prefill_tps = out.num_computed_tokens / elapsed
            else:
                decode_tps = out.num_computed_tokens / elapsed
            bar.set_postfix(prefill=f"{prefill_tps:.0f} tok/s", decode=f"{decode_tps:.0f} tok/s")
            bar.update(len(out.finished))
        bar.close()

    def _output(self, seq) -> RequestOutput:
        out = self._sample_output(seq)
        out.samples = [self._sample_output(s) for s in seq.samples[1:]]
        return out

    def _sample_output(self, seq) -> RequestOutput:
        ids = seq.completion_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=ids,
                             text=text, finish_reason=seq.finish_reason.value, logprobs=list(seq.output_logprobs),
                             num_cached_tokens=seq.num_prefix_hit_tokens,
                             top_logprobs=list(seq.output_top_logprobs),
                             prompt_logprobs=list(seq.prompt_logprobs or ()),
                             prompt_top_logprobs=list(seq.prompt_top_logprobs or ()), index=seq.index)


def _is_token_ids(prompts: Prompt | Seq[Prompt]) -> TypeIs[list[int]]:
    """One prompt given as token ids (a non-empty list whose first item is an int)."""
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
