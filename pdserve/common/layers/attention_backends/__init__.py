"""Attention backends by name, imported lazily: ``"torch"`` (reference), ``"triton"`` (own
kernels), ``"auto"`` (first importable of ``AUTO_ORDER`` for the device type)."""
from __future__ import annotations

import importlib
import logging

from pdserve.common.layers.attention_backends.base import AttentionBackend

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, str] = {
    "torch": "pdserve.common.layers.attention_backends.torch_backend:TorchBackend",
    "triton": "pdserve.common.layers.attention_backends.triton_backend:TritonBackend",
}
_INSTANCES: dict[str, AttentionBackend] = {}

# What "auto" tries, in order, per device type; the last entry of each must always import.
AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("triton", "torch"), "cpu": ("torch",)}


def register_backend(name: str, target: str) -> None:
    """Register ``"module.path:ClassName"`` under ``name`` (imported on first use)."""
    _REGISTRY[name] = target


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_backend_name(name: str, device_type: str) -> str:
    """Turn ``"auto"`` into the first backend of ``AUTO_ORDER[device_type]`` (``"cpu"``'s for an
    unknown device type) that imports; any other name is returned unchanged."""
    if name != "auto":
        return name
    order = AUTO_ORDER.get(device_type, AUTO_ORDER["cpu"])
    for candidate in order:
        try:
            get_backend(candidate)
        except ImportError as e:
            logger.info("attention backend %r is not importable here (%s); trying the next", candidate, e)
            continue
        return candidate
    raise RuntimeError(f"no attention backend of {order} imports on device type {device_type!r}")


def get_backend(name: str) -> AttentionBackend:
    """The backend instance registered as ``name``; raises ValueError for an unknown name and
    ImportError when its module (or a package it needs) cannot be imported."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(available_backends())}")
    if name not in _INSTANCES:
        module_name, class_name = _REGISTRY[name].split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        _INSTANCES[name] = cls()
    return _INSTANCES[name]
