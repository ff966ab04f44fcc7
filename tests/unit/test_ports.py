"""Free ports for services (pdserve/loadtest/ports.py)."""
from __future__ import annotations

import socket
import threading

import pytest

from pdserve.loadtest import ports


def test_free_ports_avoid_the_ephemeral_range_and_never_repeat():
    lo, hi = ports.ephemeral_range()
    picked = ports.free_ports(50, consecutive=2)
    got = [p + k for p in picked for k in range(2)]
    assert len(set(got)) == 100                          # no port handed out twice
    if len(ports.candidate_ports()) >= ports.MIN_CANDIDATES and ports.candidate_ports()[0] == ports.LOWEST_PORT:
        assert not [p for p in got if lo <= p <= hi]     # none an outgoing connection may take
    assert all(ports.bindable(p) for p in got)
    base = ports.free_port_range(16)
    assert not set(range(base, base + 16)) & set(got)


def test_a_port_held_on_any_address_is_not_bindable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not ports.bindable(s.getsockname()[1])


def test_threads_never_get_the_same_port():
    out: list[int] = []
    lock = threading.Lock()

    def pick() -> None:
        got = ports.free_ports(20)
        with lock:
            out.extend(got)

    threads = [threading.Thread(target=pick) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == len(set(out)) == 80


def _fresh(monkeypatch, lo: int, hi: int) -> None:
    ports.ephemeral_range.cache_clear()
    ports.candidate_ports.cache_clear()
    ports._candidate_set.cache_clear()
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (lo, hi))


@pytest.fixture
def restore_caches():
    yield
    ports.candidate_ports.cache_clear()
    ports._candidate_set.cache_clear()


def test_a_range_covering_every_port_falls_back_with_a_warning(monkeypatch, restore_caches, caplog):
    _fresh(monkeypatch, 1024, 65535)          # a host tuned to the widest range
    with caplog.at_level("WARNING", logger="pdserve.loadtest.ports"):
        cands = ports.candidate_ports()
    assert cands == tuple(range(20000, 60000))
    assert "ephemeral port range 1024-65535" in caplog.text
    assert 20000 <= ports.free_port() < 60000


def test_the_candidates_sit_on_both_sides_of_the_range(monkeypatch, restore_caches):
    _fresh(monkeypatch, 32768, 60999)
    cands = ports.candidate_ports()
    assert cands[0] == 10000 and 32767 in cands and 32768 not in cands and 60999 not in cands
    assert cands[-1] == 65535
    base = ports.free_port_range(8)
    assert all(p in cands for p in range(base, base + 8))   # a block never straddles the range
