"""The OpenAI API's side of the request path: an :class:`ApiRequest` -> jobs -> the router's
:class:`~pdserve.router.flow.Flow`, in this process and event loop (no second hop).

Each choice's input goes through :meth:`GenerationServicer.job` (validation, tokenization,
the context check), exactly as a gRPC ``Generate`` does, then through ``Flow.generate`` (the one
routing decision, the workers, stop strings, detokenization). Closing the generators here
(client gone) closes the flow's, which cancels the request on every worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import TypeVar

from pdserve.router.flow import Flow, Job
from pdserve.router.openai_api import responses as R
from pdserve.router.openai_api.errors import ApiError, from_exception
from pdserve.router.openai_api.requests import CHAT, ApiRequest
from pdserve.router.output import TextOutput
from pdserve.router.servicer import GenerationServicer

METHODS = {CHAT: "ChatCompletions", "text_completion": "Completions"}   # the router's request metrics
T = TypeVar("T")


class OpenAIFront:
    def __init__(self, servicer: GenerationServicer, flow: Flow, served_names: tuple[str, ...] = (),
                 aliases: tuple[str, ...] = ()) -> None:
        self.servicer = servicer
        self.flow = flow
        self.names = served_names or (servicer.spec.name,)
        # also answered to, not listed: the model's own name and the router's --model value
        self.aliases = frozenset((servicer.spec.name, *aliases))
        self.created = int(time.time())

    # ---- models ---------------------------------------------------------------------------
    def models(self) -> dict:
        info = {"max_model_len": self.servicer.registry.max_model_len(), "vocab_size": self.servicer.spec.vocab_size}
        return {"object": "list", "data": [{"id": n, "object": "model", "created": self.created,
                                            "owned_by": "pdserve", "root": self.servicer.spec.name, **info}
                                           for n in self.names]}

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this router does not serve."""
        if not requested:
            return self.names[0]
        if requested in self.names or requested in self.aliases:
            return requested
        raise ApiError(404, f"The model `{requested}` does not exist (served: {', '.join(self.names)})",
                       param="model", code="model_not_found")

    # ---- jobs -----------------------------------------------------------------------------
    def jobs(self, api: ApiRequest) -> list[Job]:
        """One job per input, all validated before any runs; errors name the body's fields."""
        out = []
        for req, name in zip(api.inputs, api.input_fields):
            try:
                out.append(self.servicer.job(req, None))
            except Exception as e:  # noqa: BLE001 - mapped to OpenAI's shape, field renamed
                self.flow.metrics.rejected(METHODS[api.kind], e)     # refused before it ran
                raise from_exception(e, name, api.max_tokens_field) from e
        return out

    def token_strings(self, ids: list[int]) -> list[str]:
        tok = self.servicer.tokenizer
        return [tok.decode([i], skip_special_tokens=False) for i in ids] if tok is not None else [str(i) for i in ids]

    # ---- generation -----------------------------------------------------------------------
    async def steps(self, api: ApiRequest, jobs: list[Job]
                    ) -> AsyncGenerator[tuple[int, TextOutput], None]:
        """(choice index, output) as the flow produces them; several choices interleave."""
        method = METHODS[api.kind]
        if len(jobs) == 1:
            gen = self.flow.generate(jobs[0], method)
            try:
                async for resp in gen:
                    yield 0, resp
            finally:
                await gen.aclose()
            return
        async for item in _merge([self.flow.generate(j, method) for j in jobs]):
            yield item

    async def complete(self, api: ApiRequest, jobs: list[Job], model: str) -> dict:
        """The whole response of a non-streamed request."""
        choices = [R.Choice(k, len(j.prompt.token_ids)) for k, j in enumerate(jobs)]
        async with contextlib.aclosing(self.steps(api, jobs)) as steps:
            async for k, resp in steps:
                _add(choices[k], resp)
        lps = [self._logprobs(api, c.token_ids, c.logprobs, 0) if api.logprobs else None for c in choices]
        return R.response(api.kind, api.id, int(time.time()), model, choices, lps)

    async def stream(self, api: ApiRequest, jobs: list[Job], model: str) -> AsyncGenerator[bytes, None]:
        """Server-sent events: a chunk per step and choice, the usage chunk, ``[DONE]``."""
        created = int(time.time())
        choices = [R.Choice(k, len(j.prompt.token_ids)) for k, j in enumerate(jobs)]
        first = [True] * len(jobs)
        async with contextlib.aclosing(self.steps(api, jobs)) as steps:
            async for k, resp in steps:
                c = choices[k]
                offset = sum(len(t) for t in c.texts)
                _add(c, resp)
                lp = self._logprobs(api, list(resp.token_ids), list(resp.logprobs), offset) if api.logprobs else None
                ch = R.chunk(api.kind, api.id, created, model, k, resp.text, first[k], c.finish_reason, lp)
                first[k] = False
                if api.continuous_usage:
                    ch["usage"] = R.usage(choices)
                yield R.sse(ch)
        if api.include_usage:
            yield R.sse(R.usage_chunk(api.kind, api.id, created, model, choices))
        yield R.DONE

    def _logprobs(self, api: ApiRequest, ids: list[int], lps: list[float], offset: int) -> dict:
        tokens = self.token_strings(ids)
        if api.kind == CHAT:
            return R.chat_logprobs(tokens, lps)
        return R.completion_logprobs(tokens, lps, offset)


def _add(c: R.Choice, resp: TextOutput) -> None:
    c.texts.append(resp.text)
    c.token_ids.extend(resp.token_ids)
    c.logprobs.extend(resp.logprobs)
    if resp.finish_reason is not None:
        c.finish_reason = R.FINISH_REASONS.get(resp.finish_reason, "stop")
        c.matched_stop = resp.matched_stop
        c.cached_tokens = resp.num_cached_tokens
        c.prompt_tokens = resp.num_prompt_tokens or c.prompt_tokens


async def _merge(gens: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """(index, item) from several async generators at once; the first error ends all of them."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(k: int, gen: AsyncGenerator[T, None]) -> None:
        try:
            async for item in gen:
                await queue.put((k, item, None))
            await queue.put((k, end, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((k, end, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.ensure_future(pump(k, g)) for k, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            k, item, err = await queue.get()
            if err is not None:
                raise err
            if item is end:
                running -= 1
                continue
            yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
