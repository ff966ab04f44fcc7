"""The OpenAI API's side of the request path: an :class:`ApiRequest` -> jobs -> the router's
:class:`~pdserve.router.flow.Flow`, in this process and event loop (no second hop).

Each choice's input goes through :meth:`GenerationServicer.job` (validation, tokenization,
the context check), exactly as a gRPC ``Generate`` does, then through ``Flow.generate`` (the one
routing decision, the workers, stop strings, detokenization). Closing the generators here
(client gone) closes the flow's, which cancels the request on every worker. With ``n`` > 1 a
prompt is one request of n samples (``params.n``): one prefill, the samples forked on the worker
that decodes, their outputs told apart by ``TextOutput.index`` (choice ``k * n + index``). A chat with tools is rendered
here (tools.render) and its output shaped into ``tool_calls`` (tools.py, tool_stream.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator
from typing import TypeVar

from pdserve.router.flow import Flow, Job
from pdserve.router.openai_api import logprobs as L
from pdserve.router.openai_api import responses as R
from pdserve.router.openai_api import tools
from pdserve.router.openai_api.errors import ApiError, bad_request, from_exception
from pdserve.router.openai_api.requests import CHAT, ApiRequest
from pdserve.router.openai_api.tool_stream import ToolStream
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
        """One job per choice (the n samples of a prompt share one), all validated before any
        runs; errors name the body's fields."""
        if api.chat_messages:
            self._render_chat(api)
        out: list[Job] = []
        for k, (req, name) in enumerate(zip(api.inputs, api.input_fields)):
            if k % api.n:
                out.append(out[-1])      # another sample of the prompt's request
                continue
            try:
                out.append(self.servicer.job(req, None))
            except Exception as e:  # noqa: BLE001 - mapped to OpenAI's shape, field renamed
                self.flow.metrics.rejected(METHODS[api.kind], e)     # refused before it ran
                raise _renamed(from_exception(e, name, api.max_tokens_field), api) from e
        return out

    def _render_chat(self, api: ApiRequest) -> None:
        """Render a chat with tools (or tool turns) into every input's text."""
        tok = self.servicer.tokenizer
        if tok is None or not tok.has_chat_template:
            raise bad_request("messages", f"model {self.servicer.spec.name!r} has no chat template")
        try:
            text = tools.render(tok.hf, list(api.chat_messages), api.tools, api.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja errors (raise_exception in templates)
            raise bad_request("messages", f"chat template failed: {e}") from e
        for req in api.inputs:
            req.text = text
            req.add_special_tokens = False

    def token_strings(self, ids: list[int]) -> list[str]:
        tok = self.servicer.tokenizer
        return [tok.decode([i], skip_special_tokens=False) for i in ids] if tok is not None else [str(i) for i in ids]

    # ---- generation -----------------------------------------------------------------------
    async def steps(self, api: ApiRequest, jobs: list[Job]
                    ) -> AsyncGenerator[tuple[int, TextOutput], None]:
        """(choice index, output) as the flow produces them; several choices interleave. One flow
        per prompt; its sample ``index`` is choice ``k * n + index``. An echo without generation
        (``echo_only``) has its one token dropped here."""
        async with contextlib.aclosing(self._steps(api, jobs)) as steps:    # closed: the flows too
            async for k, resp in steps:
                if api.echo_only:
                    resp = dataclasses.replace(resp, token_ids=[], logprobs=[], top_logprobs=[], text="",
                                               num_output_tokens=0)
                yield k, resp

    async def _steps(self, api: ApiRequest, jobs: list[Job]) -> AsyncGenerator[tuple[int, TextOutput], None]:
        method, n = METHODS[api.kind], api.n
        requests = jobs[::n]
        if len(requests) == 1:
            gen = self.flow.generate(requests[0], method)
            try:
                async for resp in gen:
                    yield resp.index, resp
            finally:
                await gen.aclose()
            return
        async for k, resp in _merge([self.flow.generate(j, method) for j in requests]):
            yield k * n + resp.index, resp

    async def complete(self, api: ApiRequest, jobs: list[Job], model: str) -> dict:
        """The whole response of a non-streamed request."""
        choices = [R.Choice(k, len(j.prompt.token_ids)) for k, j in enumerate(jobs)]
        async with contextlib.aclosing(self.steps(api, jobs)) as steps:
            async for k, resp in steps:
                _add(choices[k], resp)
        for c in choices:
            _share_prompt(choices, c.index, api.n)
        lps = []
        for c, job in zip(choices, jobs):
            lps.append(self._logprobs(api, c, job, c.token_ids, c.logprobs, c.top_logprobs, 0, api.echo))
            if api.echo:
                c.texts.insert(0, self._echo_text(api, c.index, job))
        messages = [_tool_message(api.tools, c) for c in choices] if _uses_tools(api) else None
        if not api.keep:
            return R.response(api.kind, api.id, int(time.time()), model, choices, lps, messages)
        picked = R.best_of(choices, api.n, api.keep)
        kept = [dataclasses.replace(choices[i], index=k) for k, i in enumerate(picked)]
        return R.response(api.kind, api.id, int(time.time()), model, kept, [lps[i] for i in picked],
                          [messages[i] for i in picked] if messages is not None else None, usage_of=choices)

    async def stream(self, api: ApiRequest, jobs: list[Job], model: str) -> AsyncGenerator[bytes, None]:
        """Server-sent events: a chunk per step and choice, the usage chunk, ``[DONE]``."""
        created = int(time.time())
        choices = [R.Choice(k, len(j.prompt.token_ids)) for k, j in enumerate(jobs)]
        first = [True] * len(jobs)
        streams = [ToolStream(api.tools) for _ in jobs] if api.tools is not None and _uses_tools(api) else None
        async with contextlib.aclosing(self.steps(api, jobs)) as steps:
            async for k, resp in steps:
                c = choices[k]
                offset = sum(len(t) for t in c.texts)
                _add(c, resp)
                _share_prompt(choices, k, api.n)
                echo = api.echo and first[k]
                lp = self._logprobs(api, c, jobs[k], list(resp.token_ids), list(resp.logprobs), resp.top_logprobs,
                                    offset, echo)
                text = resp.text
                if echo:          # the prompt goes out first, with the first step
                    c.texts.insert(0, self._echo_text(api, k, jobs[k]))
                    text = c.texts[0] + text
                if streams is None:
                    chunks = [R.chunk(api.kind, api.id, created, model, k, text, first[k], c.finish_reason, lp)]
                else:
                    chunks = _tool_chunks(api, created, model, c, streams[k], resp.text, first[k], lp)
                first[k] = False
                for ch in chunks:
                    if api.continuous_usage:
                        ch["usage"] = R.usage(choices)
                    yield R.sse(ch)
        if api.include_usage:
            yield R.sse(R.usage_chunk(api.kind, api.id, created, model, choices))
        yield R.DONE

    def _logprobs(self, api: ApiRequest, c: R.Choice, job: Job, ids: list[int], lps: list[float],
                  tops: list, offset: int, echo: bool) -> dict | None:
        """The logprobs object of ``ids`` (None when not asked); ``echo``: the prompt's first."""
        if not api.logprobs:
            return None
        if api.kind == CHAT:
            return L.chat_logprobs(self.token_strings, ids, lps, tops)
        if echo:
            return L.echo_logprobs(self.token_strings, list(job.prompt.token_ids), c.prompt_logprobs,
                                   c.prompt_top_logprobs, ids, lps, tops, api.top_logprobs)
        return L.completion_logprobs(self.token_strings, ids, lps, offset, tops if api.top_logprobs else None)

    def _echo_text(self, api: ApiRequest, k: int, job: Job) -> str:
        """Choice ``k``'s prompt as echoed: the text sent, or its token ids decoded."""
        req = api.inputs[k]
        if req.WhichOneof("input") == "text":
            return req.text
        tok = self.servicer.tokenizer
        return tok.decode(list(job.prompt.token_ids), skip_special_tokens=False) if tok is not None else ""


def _add(c: R.Choice, resp: TextOutput) -> None:
    c.texts.append(resp.text)
    c.token_ids.extend(resp.token_ids)
    c.logprobs.extend(resp.logprobs)
    c.top_logprobs.extend(resp.top_logprobs)
    c.prompt_logprobs.extend(resp.prompt_logprobs)
    c.prompt_top_logprobs.extend(resp.prompt_top_logprobs)
    if resp.finish_reason is not None:
        c.finish_reason = R.FINISH_REASONS.get(resp.finish_reason, "stop")
        c.matched_stop = resp.matched_stop
        c.cached_tokens = resp.num_cached_tokens
        c.prompt_tokens = resp.num_prompt_tokens or c.prompt_tokens


def _share_prompt(choices: list[R.Choice], k: int, n: int) -> None:
    """Choice ``k``'s prompt logprobs from the first sample of its prompt (the workers send
    them with sample 0 only; sample 0's first token comes before any other sample's)."""
    c, first = choices[k], choices[k - k % n]
    if c is not first and not c.prompt_logprobs:
        c.prompt_logprobs, c.prompt_top_logprobs = first.prompt_logprobs, first.prompt_top_logprobs


def _uses_tools(api: ApiRequest) -> bool:
    return api.kind == CHAT and api.tools is not None and api.tools.choice != "none"


def _renamed(err: ApiError, api: ApiRequest) -> ApiError:
    """A guide's error (``guide.<kind>``) renamed to the body field the guide came from."""
    if err.param and err.param.startswith("guide") and api.guide_param:
        detail = err.message[len(err.param) + 2:] if err.message.startswith(err.param + ": ") else err.message
        return bad_request(api.guide_param, detail)
    return err


def _tool_message(req: tools.ToolRequest | None, c: R.Choice) -> dict:
    """A finished chat choice's message with its tool calls (its finish reason updated)."""
    assert req is not None
    content, calls = tools.parse_output(req, "".join(c.texts))
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.to_json() for call in calls]
        if req.choice != "named" and c.finish_reason == "stop":
            c.finish_reason = "tool_calls"
    return message


def _tool_chunks(api: ApiRequest, created: int, model: str, c: R.Choice, stream: ToolStream, text: str,
                 first: bool, lp: dict | None) -> list[dict]:
    """The chunks of one step of a streamed choice with tools (finish reason on the last)."""
    finished = c.finish_reason is not None
    deltas = stream.deltas(text, finished)
    if not deltas and (first or finished):
        deltas = [{}]
    reason = (stream.finish_reason_override or c.finish_reason) if finished else None
    out = []
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        out.append(R.chunk(api.kind, api.id, created, model, c.index, "", first and i == 0,
                           reason if last else None, lp if last else None, delta))
    return out


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

    tasks = {k: asyncio.ensure_future(pump(k, gen)) for k, gen in enumerate(gens)}
    try:
        running = len(gens)
        while running:
            k, item, err = await queue.get()
            if err is not None:
                raise err
            if item is end:
                running -= 1
                continue
            yield k, item
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
