"""The engine: Sequence, BlockManager, Scheduler, ModelRunner, LLMEngine and the offline LLM API.

Imports are lazy so that ``from common.engine import SamplingParams`` does not load torch models.
"""
from __future__ import annotations

from common.engine.sampling_params import InvalidParameter, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "InvalidParameter", "RequestOutput"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from common.engine import llm
        return getattr(llm, name)
    if name == "LLMEngine":
        from common.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
