"""When a guided sequence stops because of its grammar (checked after each appended token).

A grammar that accepted its stop token is done: FinishReason.STOP, whatever ``ignore_eos`` says
(nothing may follow). A token the grammar refused (only possible for one that came from outside
this engine's sampler) ends the request with FinishReason.ERROR rather than emit invalid output.
"""
from __future__ import annotations

from pdserve.common.engine.sequence import PLACEHOLDER, Sequence
from pdserve.common.outputs import FinishReason


def reason(seq: Sequence) -> FinishReason | None:
    """Advance ``seq``'s guide over its new tokens; why the grammar ends it, or None (also for an
    unguided sequence)."""
    state = seq.guide
    if state is None:
        return None
    tokens = seq.completion_token_ids
    if PLACEHOLDER in tokens[state.num_accepted:]:
        return None     # not known yet (overlapped step): checked when it resolves
    if not state.advance(tokens):
        return FinishReason.ERROR
    return FinishReason.STOP if state.is_terminated else None
