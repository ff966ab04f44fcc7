"""A streamed chat choice with tools: its text deltas -> OpenAI ``delta`` objects with
``tool_calls``, in the shape the openai SDK assembles (first delta of a call: index, id, type,
function name and ``arguments: ""``; later deltas: index and an ``arguments`` fragment).

- named choice: the output is the arguments: the call's header goes out with the first delta,
  then every text delta is an arguments fragment.
- required: the output is one ``{"name", "arguments"}`` object: buffered, and sent as one call
  when the choice finishes.
- auto: text is streamed as content until a ``<tool_call>`` marker begins (a tail that may be the
  start of one is held back); from there the rest is buffered and parsed when it finishes. (A
  bare JSON call without the marker is recognised in whole answers only.)
"""
from __future__ import annotations

from pdserve.router.openai_api import tools as T

MARKER = "<tool_call>"


class ToolStream:
    """One choice's tool-call streaming state (see the module docstring)."""

    def __init__(self, req: T.ToolRequest) -> None:
        self.req = req
        self.buffer = ""          # text not sent yet (required, auto after/around a marker)
        self.in_call = False      # auto: a marker was seen
        self.calls = 0            # tool calls sent

    @property
    def finish_reason_override(self) -> str | None:
        """``tool_calls`` once a call was sent (named choice: ``stop``, as OpenAI answers)."""
        return "tool_calls" if self.calls and self.req.choice != "named" else None

    def deltas(self, text: str, finished: bool) -> list[dict]:
        """The deltas for this step's ``text`` (no role: the caller adds it to the first)."""
        if self.req.choice == "named":
            return self._named(text)
        if self.req.choice == "none":
            return [{"content": text}] if text else []
        self.buffer += text
        if self.req.choice == "auto" and not self.in_call:
            out = self._content_before_marker(finished)
            return out + self._calls() if finished and self.in_call else out
        return self._calls() if finished else []

    def _named(self, text: str) -> list[dict]:
        out = []
        if not self.calls:
            self.calls = 1
            assert self.req.named is not None
            call = T.ToolCall(self.req.named, "", T.new_call_id())
            out.append({"tool_calls": [call.to_json(0)]})
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _content_before_marker(self, finished: bool) -> list[dict]:
        """Send the buffered content up to a marker (or up to a possible start of one)."""
        at = self.buffer.find(MARKER)
        if at >= 0:
            self.in_call = True
            send, self.buffer = self.buffer[:at], self.buffer[at:]
        elif finished:
            send, self.buffer = self.buffer, ""
        else:
            keep = _partial_marker(self.buffer)
            send, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return [{"content": send}] if send else []

    def _calls(self) -> list[dict]:
        content, calls = T.parse_output(self.req, self.buffer)
        self.buffer = ""
        out: list[dict] = [{"content": content}] if content and not calls else []
        for call in calls:
            out.append({"tool_calls": [call.to_json(self.calls)]})
            self.calls += 1
        return out


def _partial_marker(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of the marker."""
    for n in range(min(len(MARKER) - 1, len(text)), 0, -1):
        if MARKER.startswith(text[-n:]):
            return n
    return 0
