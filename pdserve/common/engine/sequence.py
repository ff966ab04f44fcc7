"""A request's token sequence and its place in the paged KV cache."""
from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING

from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pdserve.common.guided.state import GuideState

PLACEHOLDER = -1   # a token sampled on the device whose value the host has not read yet


class SequenceStatus(Enum):
    WAITING = auto()   # needs (re)computation of its KV before it can decode
    RUNNING = auto()   # in the decode batch
    FINISHED = auto()


class Sequence:
    """Token ids (prompt + completion) and the KV blocks that hold them.

    ``block_table[i]`` holds tokens ``[i*block_size, (i+1)*block_size)``; the first
    ``num_cached_tokens`` have KV in the cache. A step computes ``num_scheduled_tokens`` more and
    samples a token only when that reaches ``num_tokens`` (``completes_in_step``).

    Samples of one request (``SamplingParams.n``): the sequence added is sample 0; its forks
    (engine/fork.py) share its ``request_id`` and ``samples`` (the one list of all of them, in
    index order) and differ by ``index``. Until it forks, sample 0 keeps ``fork_block_ids``: one
    block per other sample, taken at admission, for its copy of the prompt's last block.
    """

    _counter = itertools.count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 request_id: str | None = None) -> None:
        self.seq_id = next(Sequence._counter)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.last_token = self.token_ids[-1]
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0    # tokens the current step computes (set by the Scheduler)
        self.output_logprobs: list[float] = []
        # per completion token (when top_logprobs > 0): the most likely tokens' ids and raw logprobs
        self.output_top_logprobs: list[tuple[list[int], list[float]]] = []
        # prompt_logprobs: per prompt position p < num_prompt_tokens - 1, the logprob of token p + 1
        # (and its top tokens when top_logprobs > 0); None until a step scores one
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None
        self.guide: GuideState | None = None   # grammar state of a guided request (set by the engine)
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0   # prompt tokens served from the prefix cache at admission
        self.prefill_only = False        # prefill worker: stop after the first token, keep the KV
        self.tpot_slo_ms = 0.0           # this request's TPOT target for the TPOT guard; 0 = the worker's
        # CUDA event after the prefill that computed the KV (a sender waits on it); None on CPU
        self.kv_ready: torch.cuda.Event | None = None
        self.index = 0                   # sample index within its request (choices[index])
        self.samples: list[Sequence] = [self]   # every sample of the request, shared by all of them
        self.forked = False              # sample 0 after its fork (engine/fork.py)
        self.fork_block_ids: list[int] = []   # blocks reserved for the forks' last-block copies

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_forks(self) -> int:
        """Samples this sequence will still fork into (n - 1 before its fork; never for a
        prefill-only sequence: the decode worker forks it)."""
        if self.forked or self.prefill_only or self.index:
            return 0
        return self.sampling_params.n - 1

    @property
    def all_samples_finished(self) -> bool:
        """Whether every sample of the request has finished (so has the request)."""
        return all(s.is_finished for s in self.samples)

    @property
    def completes_in_step(self) -> bool:
        """Whether the scheduled step computes up to the last token (so a token is sampled)."""
        return self.num_cached_tokens + self.num_scheduled_tokens == self.num_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and has no token yet: its prefill scores every prompt
        position (engine/prompt_logprobs.py), so no prefix-cache hit may skip one."""
        return self.sampling_params.prompt_logprobs and self.num_completion_tokens == 0

    def set_prompt_logprob(self, position: int, logprob: float,
                           top: tuple[list[int], list[float]] | None) -> None:
        """Store the logprob of prompt token ``position + 1`` (and its position's top tokens)."""
        n = self.num_prompt_tokens - 1
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [0.0] * n
            if top is not None:
                self.prompt_top_logprobs = [([], [])] * n
        self.prompt_logprobs[position] = logprob
        if top is not None and self.prompt_top_logprobs is not None:
            self.prompt_top_logprobs[position] = top

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block ``i``."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int, logprob: float | None = None,
                     top: tuple[list[int], list[float]] | None = None) -> None:
        """Append a token; ``logprob`` / ``top`` (its top-``top_logprobs`` ids and logprobs) are
        kept when given."""
        self.token_ids.append(token_id)
        self.last_token = token_id
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)

    def top_of_row(self, top: tuple[list[list[int]], list[list[float]]] | None, row: int
                   ) -> tuple[list[int], list[float]] | None:
        """This sequence's share of a step's top logprobs (row ``row``, its own ``top_logprobs``
        of them); None when it asked for none."""
        k = self.sampling_params.top_logprobs
        if top is None or not k:
            return None
        return top[0][row][:k], top[1][row][:k]

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, cached={self.num_cached_tokens}, blocks={self.block_table})")
