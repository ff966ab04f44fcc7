"""Constants of the worker protocol that both sides must agree on (one definition each)."""
from __future__ import annotations

from pdserve.v1 import common_pb2

# WorkerInfo.protocol_version of this release; the router refuses a worker that speaks another.
PROTOCOL_VERSION = "v1"
# The roles that run decode (and so receive KV or Submit).
DECODE_ROLES: frozenset[int] = frozenset({common_pb2.ROLE_DECODE, common_pb2.ROLE_BOTH})
