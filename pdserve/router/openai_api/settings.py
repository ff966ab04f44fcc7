"""The HTTP API's flags (each with a ``PDSERVE_ROUTER_*`` environment default) and settings."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.common import env

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-port", type=int, default=env.get_int("ROUTER_HTTP_PORT", 0),
                   help="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, "
                        "/health); 0 = off (env PDSERVE_ROUTER_HTTP_PORT; `pdserve up` turns it on at 8000)")
    p.add_argument("--http-max-body-bytes", type=int,
                   default=env.get_int("ROUTER_HTTP_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
                   help="larger HTTP request bodies get 413 (env PDSERVE_ROUTER_HTTP_MAX_BODY_BYTES)")
    p.add_argument("--served-model-name", default=env.get("ROUTER_SERVED_MODEL_NAME", ""),
                   help="model names the HTTP API answers to, comma-separated (the first is listed first); "
                        "default: the model's own name (env PDSERVE_ROUTER_SERVED_MODEL_NAME)")


@dataclass(frozen=True)
class HttpSettings:
    port: int                               # 0 = off
    host: str = "0.0.0.0"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model_names: tuple[str, ...] = ()   # () = the model's name

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--http-port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--http-max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if any(not n.strip() for n in self.served_model_names):
            raise ValueError("--served-model-name: empty name in the list")

    @property
    def enabled(self) -> bool:
        return self.port != 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpSettings:
        names = tuple(n.strip() for n in (args.served_model_name or "").split(",") if n.strip())
        return cls(port=args.http_port, host=args.host, max_body_bytes=args.http_max_body_bytes,
                   served_model_names=names)
