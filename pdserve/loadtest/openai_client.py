"""The load generator's OpenAI HTTP backend (``pdserve bench serve --backend openai``): the same
requests and records as the gRPC backend, sent as streamed ``/v1/completions`` or
``/v1/chat/completions`` with aiohttp (one process). ``continuous_usage_stats`` gives each
chunk's token count; the last chunk's usage the prompt, output and cached counts.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.loadtest.client import LoadResult, _client_summary, _cpu_now, run_async
from pdserve.loadtest.datasets import BenchRequest
from pdserve.loadtest.metrics import RequestRecord

ENDPOINTS = ("completions", "chat")
_FINISH = {"stop": "FINISH_REASON_STOP", "length": "FINISH_REASON_LENGTH"}


@dataclass(frozen=True)
class HttpTarget:
    """Where and how requests go: ``base_url`` like ``http://127.0.0.1:8000/v1``."""

    base_url: str
    endpoint: str = "completions"
    model: str = ""
    api_key: str = ""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    @property
    def url(self) -> str:
        return f"{self.base_url}/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def payload(req: BenchRequest, target: HttpTarget) -> dict[str, Any]:
    """The JSON body of ``req`` (the same sampling as its gRPC form, ``BenchRequest.to_proto``)."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": req.output_len, "temperature": req.temperature,
                            "ignore_eos": req.ignore_eos, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if target.endpoint == "chat":
        if req.token_ids is not None:
            raise ValueError("the chat endpoint takes text: use --prompt-format text, or a jsonl dataset "
                             "of prompts or messages")
        body["messages"] = req.messages if req.messages is not None else [{"role": "user", "content": req.text or ""}]
    elif req.messages is not None:
        raise ValueError("chat prompts need --endpoint chat")
    else:
        body["prompt"] = req.token_ids if req.token_ids is not None else (req.text or "")
    return body


def _on_event(rec: RequestRecord, data: dict, t: float, seen: list[int]) -> None:
    """One chunk: a token-carrying message (with its token count) and/or the final usage."""
    if "error" in data:
        raise RuntimeError(f"error event: {data['error'].get('message', data['error'])}")
    usage = data.get("usage")
    choices = data.get("choices") or []
    if choices:
        c = choices[0]
        text = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
        tokens = (usage["completion_tokens"] - seen[0]) if usage else (1 if text else 0)
        if tokens > 0 or text:
            rec.msg_times.append(t)
            rec.msg_tokens.append(tokens)
        if usage:
            seen[0] = usage["completion_tokens"]
        if c.get("finish_reason"):
            rec.finish_reason = _FINISH.get(c["finish_reason"], c["finish_reason"])
    elif usage:
        rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
        rec.output_tokens = usage.get("completion_tokens", 0)
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def send_one(session, target: HttpTarget, body: dict, rec: RequestRecord, prompt_len: int,
                   timeout: float | None, sem: asyncio.Semaphore | None = None) -> RequestRecord:
    """One streamed request, recorded into ``rec``."""
    import aiohttp
    async with (sem if sem is not None else contextlib.nullcontext()):
        rec.prompt_tokens = prompt_len
        rec.send_time = time.perf_counter()
        seen = [0]
        try:
            async with session.post(target.url, json=body, headers=target.headers(),
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    rec.code, rec.error = f"HTTP_{resp.status}", (await resp.text())[:500]
                else:
                    done = False
                    async for line in resp.content:    # read to the end: the connection is reused
                        if done or not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            continue
                        _on_event(rec, json.loads(data), time.perf_counter(), seen)
                    rec.code = "OK" if done else "INCOMPLETE_STREAM"
        except asyncio.TimeoutError:
            rec.code = "DEADLINE_EXCEEDED"
        except Exception as e:  # noqa: BLE001 - a failed request must not end the run
            rec.code, rec.error = "CLIENT_ERROR", repr(e)
        rec.end_time = time.perf_counter()
        if not rec.output_tokens:
            rec.output_tokens = sum(rec.msg_tokens)
    return rec


async def _run(target: HttpTarget, items: Sequence[tuple[int, BenchRequest, float]], limit: int | None,
               timeout: float | None, progress) -> tuple[list[RequestRecord], dict[str, Any], float]:
    try:
        import aiohttp
    except ImportError as e:
        raise RuntimeError("--backend openai needs aiohttp: pip install 'pdserve[bench]'") from e
    bodies = [payload(req, target) for _, req, _ in items]
    sem = asyncio.Semaphore(limit) if limit else None
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        start_at = time.perf_counter() + 0.01
        cpu0 = _cpu_now()
        tasks = []
        for k, (idx, req, off) in enumerate(items):
            delay = start_at + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(index=idx, scheduled_time=start_at + off, release_time=time.perf_counter())
            task = asyncio.create_task(send_one(session, target, bodies[k], rec, req.prompt_len, timeout, sem))
            task.add_done_callback(lambda _t: progress(1))
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
        cpu1 = _cpu_now()
    wall = time.perf_counter() - start_at
    user, sys_ = cpu1[1] - cpu0[1], cpu1[2] - cpu0[2]
    info = {"requests": len(items), "concurrency_limit": limit, "process_time_s": cpu1[0] - cpu0[0],
            "cpu_user_s": user, "cpu_sys_s": sys_, "wall_s": wall,
            "cpu_util": (user + sys_) / wall if wall > 0 else 0.0}
    return records, info, start_at


def run_load(target: HttpTarget, requests: Sequence[BenchRequest], offsets: Collection[float], *,
             max_concurrency: int | None = None, timeout: float | None = 600.0, pbar=None) -> LoadResult:
    """Send ``requests[i]`` at ``start + offsets[i]`` (limited to ``max_concurrency`` in flight)."""
    if len(requests) != len(offsets):
        raise ValueError("one offset per request")
    items = [(i, r, float(o)) for i, (r, o) in enumerate(zip(requests, offsets))]
    update = (lambda n: pbar.update(n)) if pbar is not None else (lambda n: None)
    records, info, start_at = run_async(_run(target, items, max_concurrency, timeout, update))
    records.sort(key=lambda r: r.index)
    end = max((r.end_time for r in records), default=start_at)
    return LoadResult(records, start_at, max(end - start_at, 1e-9), _client_summary(records, [info], 0))


def model_info(base_url: str, api_key: str = "", timeout: float = 60.0) -> dict[str, Any]:
    """The served model from ``GET /models`` (retried until ``timeout``), in GetModelInfo's keys."""
    import urllib.error
    import urllib.request
    end = time.monotonic() + timeout
    last: Exception | None = None
    request = urllib.request.Request(base_url.rstrip("/") + "/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                card = json.loads(r.read())["data"][0]
            return {"model": card["id"], "max_model_len": card.get("max_model_len", 0),
                    "vocab_size": card.get("vocab_size", 0)}
        except urllib.error.HTTPError as e:
            if e.code < 500:        # a wrong key or URL does not get better by waiting
                raise RuntimeError(f"{base_url}/models: HTTP {e.code}: {e.read()[:300]!r}") from e
            last = e
            time.sleep(0.2)
        except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as e:
            last = e
            time.sleep(0.2)
    raise RuntimeError(f"{base_url}/models did not answer in {timeout:.0f} s: {last}")
