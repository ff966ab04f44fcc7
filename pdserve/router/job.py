"""A validated request as the router runs it (:class:`Job`): what the workers get, its deadline,
and the prompt's prefix match, computed once per try and shared by the placement's choices."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.sampling_params import SamplingParams
from pdserve.router.output import OutputProcessor
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.slo import NONE, RequestSlo
from pdserve.router.tokenization import Prompt


@dataclass
class Job:
    """A validated request, ready to run."""

    request_id: str                  # as the client sees it
    prompt: Prompt
    sampling: SamplingParams         # max_tokens resolved: what the workers get
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True
    deadline: float | None = None    # time.monotonic()
    deadline_unix_ms: int = 0
    slo: RequestSlo = NONE           # the request's own objectives (pdserve.router.slo)
    hash_chain: list[int] | None = None   # block hashes of the prompt, computed when needed
    matched: dict[str, int] | None = None  # worker -> leading blocks it holds (one index match per try)
    # Called once the request's first worker rpc is on its way (the servicer sends the client
    # its response headers then, off the path of the first token); may be called again on a retry.
    on_dispatch: Callable[[], None] | None = None
    output: OutputProcessor | None = None  # made once the first worker rpc is sent (Flow._after_send)
    origin: Job | None = None        # a migration's continuation: the request's first Job

    def dispatched(self) -> None:
        if self.on_dispatch is not None:
            self.on_dispatch()

    def chain(self, index: PrefixIndex, block_size: int) -> list[int]:
        if self.hash_chain is None:
            self.hash_chain = index.hasher.chain(self.prompt.token_ids, block_size) if block_size else []
        return self.hash_chain

    def match(self, index: PrefixIndex, block_size: int) -> dict[str, int]:
        """Every worker's cached prefix of the prompt (``PrefixIndex.match``), once per try: the
        decode pick and the prefill placement share it."""
        if self.matched is None:
            self.matched = index.match(self.chain(index, block_size)) if index else {}
        return self.matched

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline
