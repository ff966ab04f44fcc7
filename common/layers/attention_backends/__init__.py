"""Attention backends, picked by name and imported lazily.

``get_backend("torch")`` returns the reference backend; ``"triton"`` the project's own kernels
(GPU, or the CPU under TRITON_INTERPRET=1); ``"flash_attn"`` when that package is importable.
``"auto"`` picks flash_attn > triton on CUDA and torch on the CPU. Nothing GPU-only is imported
until a backend is asked for.
"""
from __future__ import annotations

import importlib

from common.layers.attention_backends.base import AttentionBackend

_REGISTRY: dict[str, str] = {
    "torch": "common.layers.attention_backends.torch_backend:TorchBackend",
    "triton": "common.layers.attention_backends.triton_backend:TritonBackend",
    "flash_attn": "common.layers.attention_backends.flash_attn_backend:FlashAttnBackend",
}
_INSTANCES: dict[str, AttentionBackend] = {}


def register_backend(name: str, target: str) -> None:
    """Register ``"module.path:ClassName"`` under ``name`` (imported on first use)."""
    _REGISTRY[name] = target


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_backend_name(name: str, device_type: str) -> str:
    """Turn ``"auto"`` into a concrete backend name for ``device_type`` ("cpu" / "cuda")."""
    if name != "auto":
        return name
    if device_type != "cuda":
        return "torch"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attn"
    return "triton"


def get_backend(name: str) -> AttentionBackend:
    """The backend instance registered as ``name``; raises ValueError for an unknown name."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(available_backends())}")
    if name not in _INSTANCES:
        module_name, class_name = _REGISTRY[name].split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        _INSTANCES[name] = cls()
    return _INSTANCES[name]
