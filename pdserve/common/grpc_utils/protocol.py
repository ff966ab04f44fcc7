"""Constants of the worker protocol that both sides must agree on (one definition each)."""
from __future__ import annotations

# WorkerInfo.protocol_version of this release; the router refuses a worker that speaks another.
PROTOCOL_VERSION = "v1"
