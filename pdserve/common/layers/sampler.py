"""Token sampling for a batch of sequences, with no host synchronisation on the device.

In fp32: raw-logit logprobs (the chosen token's and, per row, its ``top_logprobs`` most likely
tokens', under the unmasked, unpenalised distribution); the token bitmask (guided rows: forbidden
tokens at -inf, layers/token_mask.py); logit bias and the min_tokens ban (layers/logit_bias.py);
penalties; greedy rows take the argmax (lowest index on
ties); sampled rows apply temperature, top-k, top-p, min-p, then ``argmax(probs / E)``,
E ~ Exp(1), seeded rows from their own generator. The engine owns ``generators`` (seq_id ->
generator), pops a finished sequence's entry, and samples once per token appended to a seeded
sequence. The bitmask is the caller's, set per step (``SamplingBatch.token_bitmask``).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

from pdserve.common.layers.fused_dispatch import use_fused
from pdserve.common.layers.logit_bias import LogitBias, apply_logit_bias, build_logit_bias
from pdserve.common.layers.token_mask import apply_token_bitmask
from pdserve.common.sampling_params import SamplingParams


class SampledSequence(Protocol):
    """What sampling reads of a sequence (the engine's Sequence is one)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def num_completion_tokens(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def completion_token_ids(self) -> list[int]: ...

__all__ = ["SamplingBatch", "SamplerOutput", "Sampler", "prepare_sampling"]

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """Per-step sampling inputs for ``B`` rows over ``vocab_size`` tokens, on the model's device.

    The top-k/top-p/min-p flags count sampled rows only; ``output_counts`` exists only when
    ``any_penalty``, ``prompt_mask`` only when ``any_repetition_penalty`` (zero for rows without).
    """

    temperatures: torch.Tensor            # [B] fp32, 0 = greedy
    top_ks: torch.Tensor                  # [B] int64, V where off
    top_ps: torch.Tensor                  # [B] fp32, 1.0 where off
    min_ps: torch.Tensor                  # [B] fp32, 0.0 where off
    repetition_penalties: torch.Tensor    # [B] fp32, 1.0 where off
    presence_penalties: torch.Tensor      # [B] fp32, 0.0 where off
    frequency_penalties: torch.Tensor     # [B] fp32, 0.0 where off
    output_counts: torch.Tensor | None    # [B, V] fp32 (only when any_penalty)
    prompt_mask: torch.Tensor | None      # [B, V] bool (only when any_repetition_penalty)
    generators: list[torch.Generator | None]  # per row; set only for seeded sampled rows
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    any_repetition_penalty: bool
    any_additive_penalty: bool            # presence or frequency
    need_logprobs: bool
    max_top_k: int        # largest top_k among sampled rows that use top-k (0 if none)
    sort_k: int           # leading tokens the top-p path sorts (V if a sampled row has no top-k)
    seeded_rows: list[int]   # rows drawing their noise from their own generator
    any_unseeded_sampled: bool
    max_top_logprobs: int = 0     # largest top_logprobs of the batch (0: none asked)
    token_bitmask: torch.Tensor | None = None   # [B, ceil(V/32)] int32 on the device; None = all allowed
    logit_bias: LogitBias | None = None         # logit_bias / min_tokens entries; None = none

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @property
    def per_step(self) -> bool:
        """Whether the batch depends on the rows' tokens (penalties, min_tokens): rebuild it
        every step instead of reusing it while the same sequences decode."""
        return self.any_penalty or (self.logit_bias is not None and self.logit_bias.per_step)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor               # [B] int64 on the device
    logprobs: torch.Tensor | None         # [B] fp32 on the device, or None
    top_token_ids: torch.Tensor | None = None   # [B, K] int64, most likely first (K = max_top_logprobs)
    top_logprobs: torch.Tensor | None = None    # [B, K] fp32, their raw logprobs


def _advance(generator: torch.Generator, steps: int, vocab_size: int, device: torch.device) -> None:
    """Consume ``steps`` draws exactly as ``Sampler.forward`` would for one row."""
    if steps <= 0:
        return
    buf = torch.empty(vocab_size, dtype=torch.float32, device=device)
    for _ in range(steps):
        buf.exponential_(generator=generator)


def _flat_indices(rows: list[list[int]], V: int, pin: bool) -> torch.Tensor:
    """int64 host tensor of ``r * V + token`` for every token of every row (numpy: fast)."""
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    total = int(lens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
    flat += np.repeat(np.arange(len(rows), dtype=np.int64) * V, lens)
    out = torch.from_numpy(flat)
    return out.pin_memory() if pin else out


@dataclass
class _Rows:
    """Per-row sampling parameters gathered on the host, and the batch flags they imply."""

    vocab_size: int
    temps: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)
    reps: list[float] = field(default_factory=list)
    pres: list[float] = field(default_factory=list)
    freqs: list[float] = field(default_factory=list)
    gens: list[torch.Generator | None] = field(default_factory=list)
    seeded_rows: list[int] = field(default_factory=list)
    all_greedy: bool = True
    any_greedy: bool = False
    any_top_k: bool = False
    any_top_p: bool = False
    any_min_p: bool = False
    any_rep: bool = False
    any_add: bool = False
    need_logprobs: bool = False
    any_unseeded_sampled: bool = False
    max_top_logprobs: int = 0
    max_top_k: int = 0
    sort_k: int = 0

    def add(self, row: int, sp: SamplingParams, gen: torch.Generator | None) -> None:
        """Append row ``row`` (``gen``: its generator when it is a seeded sampled row)."""
        V = self.vocab_size
        k = sp.top_k if 0 < sp.top_k < V else V
        self.temps.append(sp.temperature)
        self.top_ks.append(k)
        self.top_ps.append(sp.top_p)
        self.min_ps.append(sp.min_p)
        self.reps.append(sp.repetition_penalty)
        self.pres.append(sp.presence_penalty)
        self.freqs.append(sp.frequency_penalty)
        self.gens.append(gen)
        self.any_rep |= sp.repetition_penalty != 1.0
        self.any_add |= sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
        self.need_logprobs |= sp.logprobs
        self.max_top_logprobs = max(self.max_top_logprobs, sp.top_logprobs)
        if sp.temperature == 0.0:
            self.any_greedy = True
            return
        self.all_greedy = False
        if k < V:
            self.any_top_k = True
            self.max_top_k = max(self.max_top_k, k)
        self.sort_k = max(self.sort_k, k)
        self.any_top_p |= sp.top_p < 1.0
        self.any_min_p |= sp.min_p > 0.0
        if gen is not None:
            self.seeded_rows.append(row)
        else:
            self.any_unseeded_sampled = True


def _generator(seq: SampledSequence, V: int, device: torch.device,
               generators: dict[int, torch.Generator]) -> torch.Generator | None:
    """The generator of a seeded sampled sequence (created in ``generators`` and advanced past
    its completion tokens when missing); None for greedy or unseeded rows."""
    sp = seq.sampling_params
    if sp.temperature == 0.0 or sp.seed is None:
        return None
    gen = generators.get(seq.seq_id)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(sp.seed)
        _advance(gen, seq.num_completion_tokens, V, device)
        generators[seq.seq_id] = gen
    return gen


def _penalty_tensors(seqs: Sequence[SampledSequence], V: int, device: torch.device, pin: bool,
                     any_rep: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``output_counts`` [B, V] fp32 (completion token counts of the rows with a penalty) and,
    when ``any_rep``, ``prompt_mask`` [B, V] bool (prompt tokens of the rows with one)."""
    B = len(seqs)
    outs = [seq.completion_token_ids if seq.sampling_params.has_penalties else [] for seq in seqs]
    idx = _flat_indices(outs, V, pin).to(device, non_blocking=True)     # row * V + token
    output_counts = torch.zeros(B, V, dtype=torch.float32, device=device)
    output_counts.view(-1).index_add_(0, idx, torch.ones(idx.shape, dtype=torch.float32, device=device))
    if not any_rep:
        return output_counts, None
    prompts = [seq.prompt_token_ids if seq.sampling_params.repetition_penalty != 1.0 else [] for seq in seqs]
    idx = _flat_indices(prompts, V, pin).to(device, non_blocking=True)
    prompt_mask = torch.zeros(B, V, dtype=torch.bool, device=device)
    prompt_mask.view(-1).index_fill_(0, idx, True)
    return output_counts, prompt_mask


def prepare_sampling(seqs: Sequence[SampledSequence], vocab_size: int, device: torch.device,
                     generators: dict[int, torch.Generator], eos_token_ids: Sequence[int] = ()) -> SamplingBatch:
    """Build the :class:`SamplingBatch` for ``seqs`` (row ``i`` is ``seqs[i]``); ``vocab_size``
    is the logits' width; ``eos_token_ids``: the model's, which ``min_tokens`` bans. Creates
    missing generators of seeded sampled sequences in the engine-owned ``generators``, advanced
    past their existing completion tokens."""
    device = torch.device(device)
    V = int(vocab_size)
    pin = device.type == "cuda"
    rows = _Rows(V)
    for i, seq in enumerate(seqs):
        rows.add(i, seq.sampling_params, _generator(seq, V, device, generators))
    # All fp32 per-row parameters travel in one host-to-device copy; the fields are row views.
    params = torch.tensor([rows.temps, rows.top_ps, rows.min_ps, rows.reps, rows.pres, rows.freqs],
                          dtype=torch.float32, pin_memory=pin).reshape(6, len(seqs)).to(device, non_blocking=True)
    top_ks = torch.tensor(rows.top_ks, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)
    any_penalty = rows.any_rep or rows.any_add
    output_counts, prompt_mask = (_penalty_tensors(seqs, V, device, pin, rows.any_rep) if any_penalty
                                  else (None, None))
    return SamplingBatch(
        temperatures=params[0], top_ps=params[1], min_ps=params[2],
        repetition_penalties=params[3], presence_penalties=params[4], frequency_penalties=params[5],
        top_ks=top_ks, output_counts=output_counts, prompt_mask=prompt_mask,
        generators=rows.gens, vocab_size=V,
        all_greedy=rows.all_greedy, any_greedy=rows.any_greedy,
        any_top_k=rows.any_top_k, any_top_p=rows.any_top_p, any_min_p=rows.any_min_p,
        any_penalty=any_penalty, any_repetition_penalty=rows.any_rep, any_additive_penalty=rows.any_add,
        need_logprobs=rows.need_logprobs, max_top_k=rows.max_top_k, sort_k=rows.sort_k or V,
        seeded_rows=rows.seeded_rows, any_unseeded_sampled=rows.any_unseeded_sampled,
        max_top_logprobs=min(rows.max_top_logprobs, V),
        logit_bias=build_logit_bias(seqs, V, device, eos_token_ids),
    )


class Sampler(nn.Module):
    """Picks one token per row of ``logits`` [B, V]; see the module docstring for the order."""

    @torch.no_grad()
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        mask = batch.token_bitmask
        if batch.all_greedy and not batch.any_penalty and not batch.need_logprobs and batch.logit_bias is None:
            # Upcasting is exact and monotone: the argmax of the raw dtype is the same token.
            x = logits if mask is None else apply_token_bitmask(logits, mask)
            return SamplerOutput(token_ids=x.argmax(dim=-1), logprobs=None)
        if self._fused_ok(logits, batch):
            from pdserve.common.ops.sampling import temperature_sample
            seed = int(torch.randint(0, 2**31 - 1, (1,)))   # host RNG: no device sync
            x = logits if mask is None else apply_token_bitmask(logits, mask)
            return SamplerOutput(token_ids=temperature_sample(x, batch.temperatures, seed), logprobs=None)
        raw = logits.float()          # may alias ``logits``: never modified in place
        lse = torch.logsumexp(raw, dim=-1) if batch.need_logprobs else None

        x = raw if mask is None else apply_token_bitmask(raw, mask)
        x = x if batch.logit_bias is None else apply_logit_bias(x, batch.logit_bias)
        x = self._apply_penalties(x, batch) if batch.any_penalty else x

        if batch.all_greedy:
            token_ids = x.argmax(dim=-1)
        else:
            sampled = self._sample(x, batch)
            if batch.any_greedy:
                token_ids = torch.where(batch.temperatures == 0.0, x.argmax(dim=-1), sampled)
            else:
                token_ids = sampled

        if lse is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None)
        logprobs = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1) - lse
        if not batch.max_top_logprobs:
            return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
        top = raw.topk(batch.max_top_logprobs, dim=-1)      # sorted, most likely first
        return SamplerOutput(token_ids, logprobs, top.indices, top.values - lse.unsqueeze(1))

    @staticmethod
    def _fused_ok(logits: torch.Tensor, batch: SamplingBatch) -> bool:
        """Temperature-only unseeded rows on CUDA: one fused pass (ops/sampling.py)."""
        return (use_fused(logits) and not batch.any_penalty and not batch.need_logprobs and batch.logit_bias is None
                and not batch.any_top_k and not batch.any_top_p and not batch.any_min_p
                and not batch.seeded_rows)

    @staticmethod
    def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        counts = batch.output_counts
        assert counts is not None
        if batch.any_repetition_penalty:
            assert batch.prompt_mask is not None
            seen = batch.prompt_mask | (counts > 0)
            rp = batch.repetition_penalties.unsqueeze(1)
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        if batch.any_additive_penalty:
            x = (x - counts * batch.frequency_penalties.unsqueeze(1)
                 - (counts > 0).float() * batch.presence_penalties.unsqueeze(1))
        return x

    @staticmethod
    def _sample(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        B, V = x.shape
        temps = batch.temperatures
        if batch.any_greedy:   # greedy rows go through here too (result discarded): avoid /0
            temps = torch.where(temps > 0.0, temps, torch.ones_like(temps))
        x = x / temps.unsqueeze(1)   # new tensor: in-place edits below are safe

        if batch.any_top_p:
            _top_k_top_p(x, batch)
        elif batch.any_top_k:
            # Threshold at each row's k-th largest logit (ties with it are kept); no full sort.
            top_vals = x.topk(batch.max_top_k, dim=-1).values
            idx = (batch.top_ks.clamp(max=batch.max_top_k) - 1).unsqueeze(1)
            kth = top_vals.gather(1, idx)
            kth = kth.masked_fill(batch.top_ks.unsqueeze(1) >= V, _NEG_INF)
            x.masked_fill_(x < kth, _NEG_INF)

        if batch.any_min_p:
            # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); min_p = 0 gives -inf (no-op).
            thresh = x.amax(dim=-1, keepdim=True) + torch.log(batch.min_ps).unsqueeze(1)
            x.masked_fill_(x < thresh, _NEG_INF)

        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        if batch.any_unseeded_sampled:
            noise.exponential_()
        for i in batch.seeded_rows:
            noise[i].exponential_(generator=batch.generators[i])
        noise.clamp_min_(torch.finfo(torch.float32).tiny)   # never 0/0 on a filtered token
        return probs.div_(noise).argmax(dim=-1)


def _top_k_top_p(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Top-k then top-p, in place on ``x``, from each row's ``sort_k`` largest logits, each as one
    cut-off logit per row (ties kept), so a row's result never depends on the batch's path."""
    V = x.shape[1]
    if batch.sort_k >= V:
        vals = x.sort(dim=-1, descending=True).values
    else:   # every sampled row uses top-k <= sort_k: only those tokens can survive
        vals = x.topk(batch.sort_k, dim=-1, sorted=True).values
    width = vals.shape[1]
    if batch.any_top_k:
        kth = vals.gather(1, (batch.top_ks.clamp(max=width) - 1).unsqueeze(1))
        vals.masked_fill_(vals < kth, _NEG_INF)
    # Nucleus after top-k: keep n = 1 + #(inclusive cumsum < top_p) sorted positions.
    cum = torch.softmax(vals, dim=-1).cumsum_(dim=-1)
    n_keep = (cum < batch.top_ps.unsqueeze(1)).sum(dim=-1, keepdim=True) + 1
    n_keep = torch.where((batch.top_ps < 1.0).unsqueeze(1), n_keep, width)
    n_keep = torch.minimum(n_keep, (vals > _NEG_INF).sum(dim=-1, keepdim=True)).clamp_(min=1)
    cutoff = vals.gather(1, n_keep - 1)
    x.masked_fill_(x < cutoff, _NEG_INF)
