"""The router's --event-loop choice: uvloop where installed (auto), asyncio on request or as the
fallback without uvloop, and a clear error when uvloop is asked for but missing. (The router
tests in test_router_integration.py run real routers with the default, auto.)"""
from __future__ import annotations

import argparse
import asyncio
import sys

import pytest

from pdserve.router import main as router_main  # noqa: E402


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    router_main.add_arguments(p)
    return p.parse_args(argv)


def test_default_is_auto_and_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_ROUTER_EVENT_LOOP", raising=False)
    assert _args([]).event_loop == "auto"
    monkeypatch.setenv("PDSERVE_ROUTER_EVENT_LOOP", "asyncio")
    assert _args([]).event_loop == "asyncio"
    assert _args(["--event-loop", "uvloop"]).event_loop == "uvloop"
    with pytest.raises(SystemExit):
        _args(["--event-loop", "trio"])


def test_asyncio_on_request() -> None:
    assert router_main._loop_runner("asyncio") is asyncio.run


def test_uvloop_when_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert router_main._loop_runner("auto") is uvloop.run
    assert router_main._loop_runner("uvloop") is uvloop.run


def test_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)     # makes `import uvloop` raise ImportError
    assert router_main._loop_runner("auto") is asyncio.run
    with pytest.raises(ImportError):
        router_main._loop_runner("uvloop")
    assert router_main.run(_args(["--event-loop", "uvloop"])) == 2
