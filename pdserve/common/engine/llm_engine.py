"""The engine loop: requests in, one scheduled step at a time, tokens out.

Used in-process by the offline ``LLM`` and by the workers. Never imports gRPC or protobuf.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.common.config import EngineConfig
from pdserve.common.engine import fork, guide_stop, overlap
from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.handoff import KvHandoff
from pdserve.common.engine.model_runner import LaunchedStep, ModelRunner
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.step_timer import StepTimer
from pdserve.common.engine.tpot_guard import TpotGuard
from pdserve.common.engine.warmup import scratch_blocks, warm_up
from pdserve.common.guided.state import GuideCompiler
from pdserve.common.loader import ModelSource, resolve_model
from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)


class DuplicateRequest(ValueError):
    """A request id that is already in flight."""
DEFAULT_MAX_MODEL_LEN = 8192
STATS_LOG_INTERVAL_S = 10.0


@dataclass
class StepOutput:
    """What one step did: each sequence that got a token, and which finished."""

    is_prefill: bool               # the step computed prompt tokens (it may also have decode rows)
    seqs: list[Sequence] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    num_computed_tokens: int = 0   # tokens computed: prompt chunks plus one per decode row
    num_decode_rows: int = 0       # rows that decoded one token (a step with both is "mixed")

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_computed_tokens - self.num_decode_rows


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 kv_event_sink: Callable[[str, int], None] | None = None) -> None:
        self.config = config
        self.source = source or resolve_model(config.model)
        self.model_runner = ModelRunner(config, self.source)
        num_blocks = self.model_runner.allocate_kv_cache()
        self.max_model_len = self._max_model_len(num_blocks)
        self.model_runner.capture_cuda_graphs(self.max_model_len)
        sink = kv_event_sink
        self.block_manager = BlockManager(
            num_blocks, config.block_size,
            on_stored=(lambda h: sink("stored", h)) if sink else None,
            on_evicted=(lambda h: sink("evicted", h)) if sink else None)
        if self.model_runner.device.type == "cuda" and config.warmup:
            warm_up(self.model_runner, scratch_blocks(self.block_manager), self.max_model_len)
        self.eos_token_ids = self._eos_token_ids()
        self.model_runner.eos_token_ids = self.eos_token_ids
        self.scheduler = Scheduler(self._scheduler_config(), self.block_manager)
        self.tokenizer = self._load_tokenizer()
        self.guides = GuideCompiler(self.tokenizer, self.source.config.vocab_size, self.eos_token_ids)
        self.pending: overlap.PendingStep | None = None   # a step launched, its tokens not yet read
        self.step_timer = StepTimer()
        self.tpot_guard = TpotGuard(self.step_timer, config.tpot_target_ms, config.tpot_margin)
        self.scheduler.prompt_budget = self.tpot_guard.budget
        self._next_log = 0.0        # perf_counter of the next stats line (STATS_LOG_INTERVAL_S apart)
        self.overlap_enabled = self._overlap_enabled()
        self.requests: dict[str, Sequence] = {}   # queued, running or reserved
        self.kv_handoff = KvHandoff(self)         # reserve / admit (import), hold / release (export)
        # Called on the engine thread right after a prefill step is launched: ``(seqs, launched)``.
        self.on_prefill_launch: Callable[[list[Sequence], LaunchedStep], None] | None = None

    def _max_model_len(self, num_blocks: int) -> int:
        model_max = self.source.config.max_position_embeddings
        wanted = self.config.max_model_len or min(model_max, DEFAULT_MAX_MODEL_LEN)
        if wanted > model_max:
            raise ValueError(f"max_model_len ({wanted}) exceeds the model's context ({model_max})")
        # one sequence must always fit the pool, or the scheduler could never run it
        return min(wanted, num_blocks * self.config.block_size)

    def _scheduler_config(self) -> SchedulerConfig:
        c = self.config
        budget = c.max_num_batched_tokens
        if not c.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)      # every prompt must fit one step
        return SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=budget, max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids, enable_chunked_prefill=c.enable_chunked_prefill,
            max_num_partial_prefills=c.max_num_partial_prefills,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            max_mixed_batched_tokens=min(c.max_mixed_batched_tokens, budget))

    def _overlap_enabled(self) -> bool:
        setting = self.config.async_scheduling
        if setting is None:
            return self.model_runner.graph_runner is not None
        return setting

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.source.config.eos_token_ids)
        if self.source.checkpoint_dir is not None:
            gen = self.source.checkpoint_dir / "generation_config.json"
            if gen.is_file():
                eos = json.loads(gen.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return tuple(sorted(ids))

    def _load_tokenizer(self):
        if self.source.tokenizer_dir is None:
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(self.source.tokenizer_dir))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidParameter naming the field when the request cannot run here."""
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "must not be empty")
        vocab = self.source.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter("prompt_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidParameter("prompt", f"{len(prompt_token_ids)} tokens leave no room to generate "
                                             f"within the model context of {self.max_model_len} tokens")
        if params.n > self.config.max_num_seqs:
            raise InvalidParameter("n", f"{params.n} samples are more than max_num_seqs ({self.config.max_num_seqs})")
        bs = self.config.block_size
        if -(-len(prompt_token_ids) // bs) + params.n - 1 > self.block_manager.num_blocks:
            raise InvalidParameter("n", f"{params.n} samples of a {len(prompt_token_ids)}-token prompt do not fit "
                                        f"the KV pool ({self.block_manager.num_blocks} blocks of {bs})")

    def new_sequence(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str | None) -> Sequence:
        """A registered Sequence (its grammar state compiled when guided); raises
        InvalidParameter (a guide that does not compile too) or DuplicateRequest."""
        self.validate(prompt_token_ids, params)
        if request_id is not None and request_id in self.requests:
            raise DuplicateRequest(f"request_id {request_id!r} is already in flight")
        seq = Sequence(prompt_token_ids, params, self.config.block_size, request_id)
        if params.guide is not None:
            seq.guide = self.guides.new_state(params.guide)
        self.requests[seq.request_id] = seq
        return seq

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prefill_only: bool = False,
                    tpot_slo_ms: float = 0.0) -> Sequence:
        """Queue a request. ``prefill_only``: stop after the first token and keep the blocks
        (the prompt's KV) until ``kv_handoff.release``, for a prefill worker that ships them.
        ``tpot_slo_ms``: the request's own TPOT target for the TPOT guard (0 = the worker's)."""
        seq = self.new_sequence(prompt_token_ids, params, request_id)
        seq.prefill_only = prefill_only
        seq.tpot_slo_ms = tpot_slo_ms
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED,
              index: int | None = None) -> Sequence | None:
        """Finish a request wherever it is (queued, running, reserved or held), every sample of
        it, and free their blocks; None if unknown or already done. ``index``: only that sample
        (the request goes on while another runs); None if it is not running."""
        seq = self.requests.get(request_id)
        if seq is None:
            return self.kv_handoff.release_id(request_id)
        if index is not None:
            sample = next((s for s in seq.samples if s.index == index and not s.is_finished), None)
            if sample is not None:
                self.finish(sample, reason)
            return sample
        for s in seq.samples:
            if not s.is_finished:
                self.finish(s, reason)
        self.requests.pop(request_id, None)
        return seq

    def close(self) -> None:
        """Release what outlives the object: a tensor-parallel engine's other ranks."""
        self.model_runner.close()

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished() or self.pending is not None

    def step(self) -> StepOutput:
        start = time.perf_counter()
        out = self._step()
        end = time.perf_counter()
        self.step_timer.record(end - start, out.num_prefill_tokens, out.num_decode_rows)
        self.tpot_guard.observe((end - start) * 1e3, out.num_decode_rows)
        if end >= self._next_log and (out.num_prefill_tokens or out.num_decode_rows):
            self._next_log = end + STATS_LOG_INTERVAL_S
            self._log_stats()
        return out

    def _log_stats(self) -> None:
        """One INFO line of the step-time model the TPOT guard and the router read (vLLM logs its
        throughput likewise)."""
        t, sched = self.step_timer, self.scheduler
        logger.info("engine: %d running, %d waiting (%d prompt tokens); decode step %.2f ms, mixed step %.2f ms "
                    "with %.0f prompt tokens, %.4f ms a prompt token, prefill %.0f tokens/s; TPOT target %.1f ms, "
                    "credit %.1f ms",
                    len(sched.running), len(sched.waiting), sched.num_waiting_prefill_tokens(), t.decode_step_ms,
                    t.mixed_step_ms, t.mixed_prompt_tokens, t.ms_per_prompt_token, t.prefill_tokens_per_s,
                    self.tpot_guard.target_ms, self.tpot_guard.credit_ms)

    def _step(self) -> StepOutput:
        if self.pending is not None:
            prev, self.pending = self.pending, None
            self.pending = overlap.schedule_next(self, prev)
            out = StepOutput(is_prefill=prev.is_prefill, num_computed_tokens=prev.num_computed_tokens,
                             num_decode_rows=prev.num_decode_rows)
            overlap.resolve(self, prev, out)
            return out
        seqs, is_prefill = self.scheduler.schedule()
        out = StepOutput(is_prefill=is_prefill)
        if not seqs:
            return out
        if self.overlap_enabled and (is_prefill or overlap.can_overlap(self)):
            self.pending = overlap.launch(self, seqs, is_prefill, None)
            return out
        out.num_computed_tokens = sum(s.num_scheduled_tokens for s in seqs)
        out.num_decode_rows = overlap.count_decode_rows(seqs) if is_prefill else len(seqs)
        launched = self.model_runner.launch(seqs, is_prefill)
        if is_prefill:
            self.prefill_launched(launched.seqs, launched)
        token_ids, logprobs = launched.result()
        for seq in seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
        sampled = launched.seqs
        want = [s.sampling_params.logprobs for s in sampled]
        lp = [x if w else None for x, w in zip(logprobs, want)] if logprobs is not None else None
        out.finished = self.postprocess(sampled, token_ids, lp, launched.top())
        out.seqs, out.new_token_ids = sampled, token_ids
        return out

    def prefill_launched(self, seqs: list[Sequence], launched: LaunchedStep) -> None:
        if self.on_prefill_launch is not None:
            self.on_prefill_launch(seqs, launched)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], logprobs,
                    top: tuple[list[list[int]], list[list[float]]] | None = None) -> list[Sequence]:
        """Append each sequence's new token (its logprob and top logprobs when given), advance
        its guide, and finish or hold those that stop; returns them."""
        finished = []
        for i, (seq, token_id) in enumerate(zip(seqs, token_ids)):
            seq.append_token(token_id, logprobs[i] if logprobs is not None else None, seq.top_of_row(top, i))
            if seq.num_forks:
                fork.fork(self, seq)
            reason = guide_stop.reason(seq) or self.scheduler.stop_reason(seq)
            if seq.prefill_only:
                self.kv_handoff.hold(seq, reason)
                finished.append(seq)
            elif reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish one sample and free its blocks; the request leaves ``requests`` with its last."""
        self.scheduler.finish(seq, reason)
        if seq.all_samples_finished:
            self.requests.pop(seq.request_id, None)
        self.model_runner.release(seq)

    def stats(self) -> dict[str, int | float | bool]:
        bm = self.block_manager
        return {"num_total_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
                "num_used_blocks": bm.num_used_blocks, "num_cached_blocks": bm.num_cached_blocks,
                "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
                "prefix_cache_hit_tokens": bm.num_hit_tokens, "prefix_cache_query_tokens": bm.num_query_tokens,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_waiting_prefill_tokens": self.scheduler.num_waiting_prefill_tokens(),
                "num_running_context_tokens": sum(s.num_tokens for s in self.scheduler.running),
                "max_num_batched_tokens": self.scheduler.config.mixed_budget,     # what the router models
                "chunked_prefill": self.scheduler.config.enable_chunked_prefill,
                "tpot_target_ms": self.tpot_guard.target_ms,
                **self.step_timer.stats()}
