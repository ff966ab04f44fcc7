"""The attention-backend registry: every registered backend exists, and ``auto`` never picks a
backend that cannot be imported."""
from __future__ import annotations

import importlib.util

import pytest

from pdserve.common.layers import attention_backends as ab


def test_every_registered_backend_has_its_module():
    for name, target in ab._REGISTRY.items():
        module_name, class_name = target.split(":")
        assert importlib.util.find_spec(module_name) is not None, f"{name}: {module_name} does not exist"


def test_auto_skips_a_backend_that_does_not_import(monkeypatch):
    monkeypatch.setitem(ab._REGISTRY, "missing", "pdserve.common.layers.attention_backends.no_such_backend:Nope")
    monkeypatch.setitem(ab.AUTO_ORDER, "cuda", ("missing", "torch"))
    assert ab.resolve_backend_name("auto", "cuda") == "torch"
    with pytest.raises(ImportError):
        ab.get_backend("missing")


def test_auto_picks_an_importable_backend_per_device():
    for device in ("cuda", "cpu", "mps"):
        name = ab.resolve_backend_name("auto", device)
        assert name in ab.AUTO_ORDER.get(device, ab.AUTO_ORDER["cpu"])
        assert ab.get_backend(name).name == name
    assert ab.resolve_backend_name("auto", "cpu") == "torch"
    assert ab.resolve_backend_name("triton", "cpu") == "triton"     # explicit names pass through


def test_auto_fails_clearly_when_nothing_imports(monkeypatch):
    monkeypatch.setitem(ab._REGISTRY, "missing", "pdserve.common.layers.attention_backends.no_such_backend:Nope")
    monkeypatch.setitem(ab.AUTO_ORDER, "cuda", ("missing",))
    with pytest.raises(RuntimeError, match="no attention backend"):
        ab.resolve_backend_name("auto", "cuda")


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown attention backend"):
        ab.get_backend("flash_attn")
