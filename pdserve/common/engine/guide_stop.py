"""When a guided sequence stops because of its grammar (checked after each appended token).

A grammar that accepted its stop token is done: FinishReason.STOP, whatever ``ignore_eos`` says
(nothing may follow). A token the grammar refused (only possible for one that came from outside
this engine's sampler) ends the request with FinishReason.ERROR rather than emit invalid output.
"""
from __future__ import annotations

from pdserve.common.engine.sequence import Sequence
from pdserve.common.outputs import FinishReason


def reason(seq: Sequence) -> FinishReason | None:
    """Advance ``seq``'s guide over its new known tokens (up to the first PLACEHOLDER: an
    overlapped step's token not read yet, accepted when its step resolves); why the grammar
    ends it, or None (also for an unguided sequence)."""
    state = seq.guide
    if state is None:
        return None
    if not state.advance(seq.completion_token_ids):
        return FinishReason.ERROR
    return FinishReason.STOP if state.is_terminated else None
