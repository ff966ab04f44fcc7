"""The engine: Sequence, BlockManager, Scheduler, ModelRunner, LLMEngine and the offline LLM API.

Imports are lazy so that ``from pdserve.common.engine import SamplingParams`` does not load torch models.
"""
from __future__ import annotations

from pdserve.common.sampling_params import InvalidParameter, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "InvalidParameter", "RequestOutput"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from pdserve.common.engine import llm
        return getattr(llm, name)
    if name == "LLMEngine":
        from pdserve.common.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
