"""Free TCP ports for services a process is about to start (the launcher, the load tool, the
lab and the tests).

A port is picked outside the kernel's ephemeral range: a port picked by binding port 0 comes
from that range, and so do the local ports of the deployment's own outgoing connections, so
one of them could take it between the pick and the service's bind ("Address already in use"
at start-up). Picks are random (a private generator: two processes seldom pick alike), never
repeat within a process, and are bindable on every IPv4 address when picked. Where the
ephemeral range leaves fewer than ``MIN_CANDIDATES`` ports outside it (a host tuned to a wide
range), the ports of 20000-60000 are used instead, with a warning.
"""
from __future__ import annotations

import logging
import random
import socket
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

LOWEST_PORT = 10000           # below: well-known and registered services
MIN_CANDIDATES = 2000
_FALLBACK = range(20000, 60000)

_picked: set[int] = set()     # ports this process has handed out
_lock = threading.Lock()
_rng = random.Random()


def _sysctl_range() -> tuple[int, int] | None:
    """BSD / macOS: net.inet.ip.portrange.first / last."""
    try:
        out = subprocess.run(["sysctl", "-n", "net.inet.ip.portrange.first", "net.inet.ip.portrange.last"],
                             capture_output=True, text=True, timeout=5, check=True).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


@lru_cache(maxsize=1)
def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound to 0 and for outgoing connections; where it cannot be
    read, 32768-65535 (covers the Linux, BSD and Windows defaults above 32767)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        pass
    found = _sysctl_range() if sys.platform != "win32" else None
    return found if found is not None else (32768, 65535)


@lru_cache(maxsize=1)
def candidate_ports() -> tuple[int, ...]:
    """The ports picks come from (see the module docstring)."""
    lo, hi = ephemeral_range()
    ports = (*range(LOWEST_PORT, max(LOWEST_PORT, lo)), *range(min(hi + 1, 65536), 65536))
    if len(ports) >= MIN_CANDIDATES:
        return ports
    log.warning("the ephemeral port range %d-%d leaves %d ports above %d: picking from %d-%d instead, "
                "where an outgoing connection may take a port before its service binds it",
                lo, hi, len(ports), LOWEST_PORT, _FALLBACK.start, _FALLBACK.stop - 1)
    return tuple(_FALLBACK)


def bindable(port: int) -> bool:
    """Nothing holds ``port`` on any IPv4 address (a bind to 0.0.0.0 fails if one does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port_range(n: int) -> int:
    """The first of ``n`` consecutive free ports (see the module docstring): the candidates are
    walked from a random one on, each base at most once, before giving up."""
    cands = candidate_ports()
    allowed = _candidate_set()
    start = _rng.randrange(len(cands))
    with _lock:
        for k in range(len(cands)):
            base = cands[(start + k) % len(cands)]
            block = range(base, base + n)
            if any(p not in allowed or p in _picked for p in block):
                continue
            if all(bindable(p) for p in block):
                _picked.update(block)
                return base
    raise RuntimeError(f"no {n} consecutive free ports among {len(cands)} candidates")


@lru_cache(maxsize=1)
def _candidate_set() -> frozenset[int]:
    return frozenset(candidate_ports())


def free_port() -> int:
    """A free port for a service this process is about to start."""
    return free_port_range(1)


def free_ports(n: int, consecutive: int = 1) -> list[int]:
    """``n`` free ports; with ``consecutive`` = 2 each port p also has p + 1 free (worker + KV store)."""
    return [free_port_range(consecutive) for _ in range(n)]
