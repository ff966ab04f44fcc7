"""A toy placement policy, added without editing pdserve (``--pd-policy toy_placement:LastWorker``
with this folder on the router's Python path): every request decodes on the decode-capable worker
with the highest key (its address) and is prefilled there."""
from __future__ import annotations

from pdserve.router.pd_policy import LOCAL, PdDecision


class LastWorker:
    moves_decodes = False

    def __init__(self, name: str) -> None:
        self.name = name

    def choose(self, placement, job, decoders, excluded, turn):
        d = max(decoders, key=lambda c: c.key)
        return d, None, PdDecision(LOCAL, None, "toy", 0.0, 0.0, len(job.prompt.token_ids))
