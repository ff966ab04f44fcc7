"""The security of a deployment that ``pdserve up`` starts (docs/design.md, "Security"): its
flags (the services' own names and ``PDSERVE_*`` environment defaults), the random internal
token made for each deployment that brings no internal credentials, the flags each service gets
by its role, and the credentials of ``up``'s own calls to the services it started.
"""
from __future__ import annotations

import argparse
import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.common import env
from pdserve.common.security.args import add_auth_tokens_argument, add_internal_tls_arguments, internal_tls
from pdserve.common.security.config import ClientSecurity
from pdserve.common.security.tls import TlsFiles
from pdserve.common.security.tokens import BearerTokens

TOKEN_BYTES = 32            # of randomness in a per-deployment token (256 bits)
TOKEN_FILE_NAME = "internal-token"


def add_deployment_arguments(p: argparse.ArgumentParser) -> None:
    """``pdserve up``'s security flags: the internal token (made per deployment unless given or
    turned off), internal mutual TLS, the router's public-API tokens."""
    p.add_argument("--internal-token-file", default=env.get("INTERNAL_TOKEN_FILE"),
                   help="internal API token(s) of every service, one per line: the first is sent, any is "
                        "accepted (default: a random token made for this deployment, in a file only this "
                        "user can read, removed at exit) (env PDSERVE_INTERNAL_TOKEN_FILE)")
    p.add_argument("--no-internal-auth", action="store_true", default=env.get_bool("NO_INTERNAL_AUTH", False),
                   help="no internal token: anyone who reaches a worker's port may call it "
                        "(env PDSERVE_NO_INTERNAL_AUTH)")
    add_internal_tls_arguments(p)
    add_auth_tokens_argument(p)


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


@dataclass(frozen=True)
class DeploymentSecurity:
    """What every service of one deployment applies: ``token_file`` (the internal token each
    sends and accepts), ``tls`` (the internal mutual-TLS files each presents and checks peers
    against), ``server_name`` (checked in the workers' certificates), ``auth_tokens_file`` (the
    router's public port). All None: plaintext and open."""

    token_file: Path | None = None
    tls: TlsFiles | None = None
    server_name: str | None = None
    auth_tokens_file: Path | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DeploymentSecurity:
        """The settings as given (no token made here). ValueError when a file is missing or empty,
        or ``--no-internal-auth`` meets internal credentials (the services would read them from
        the environment anyway)."""
        given = cls(token_file=_path(getattr(args, "internal_token_file", None)), tls=internal_tls(args),
                    server_name=getattr(args, "internal_tls_server_name", None) or None,
                    auth_tokens_file=_path(getattr(args, "auth_tokens_file", None)))
        if getattr(args, "no_internal_auth", False) and given.internal_auth:
            raise ValueError("--no-internal-auth contradicts --internal-token-file / --internal-tls-* "
                             "(or their PDSERVE_INTERNAL_* variables): drop one")
        if given.server_name and given.tls is None:
            raise ValueError("--internal-tls-server-name needs --internal-tls-cert/-key/-ca")
        for tokens in filter(None, (given.token_file, given.auth_tokens_file)):
            BearerTokens.from_file(tokens)      # fail now, with one line, not in every child
        return given

    @property
    def internal_auth(self) -> bool:
        return self.token_file is not None or self.tls is not None

    def internal_flags(self) -> list[str]:
        """The internal-API flags of every service: a worker's port and its channels to other
        workers, the router's channels to workers."""
        flags = ["--internal-token-file", str(self.token_file)] if self.token_file else []
        if self.tls is not None:
            cert, key = self.tls.identity()
            flags += ["--internal-tls-cert", str(cert), "--internal-tls-key", str(key),
                      "--internal-tls-ca", str(self.tls.ca)]
            flags += ["--internal-tls-server-name", self.server_name] if self.server_name else []
        return flags

    def router_flags(self) -> list[str]:
        """The router's: the internal flags and its public port's tokens."""
        public = ["--auth-tokens-file", str(self.auth_tokens_file)] if self.auth_tokens_file else []
        return [*self.internal_flags(), *public]

    def internal_client(self) -> ClientSecurity:
        """How to call a worker of this deployment, as its peers do (``up``'s readiness checks)."""
        return ClientSecurity(tls=self.tls, token_file=self.token_file,
                              server_name=self.server_name if self.tls else None)

    def public_client(self) -> ClientSecurity:
        """How to call the router's public port (plaintext under ``up``), with its first token."""
        return ClientSecurity(token_file=self.auth_tokens_file)

    def public_metadata(self) -> tuple[tuple[str, str], ...]:
        """The ``authorization`` metadata of a call to the router's public port; () when open."""
        if self.auth_tokens_file is None:
            return ()
        return (("authorization", f"Bearer {BearerTokens.from_file(self.auth_tokens_file).first_token()}"),)

    def describe(self) -> str:
        """The internal API's protection, for the log (never the token)."""
        ways = [w for w, on in (("mutual TLS", self.tls is not None),
                                (f"the token in {self.token_file}", self.token_file is not None)) if on]
        return "internal API: " + (" and ".join(ways) if ways else "open (no token, no TLS)")


def write_token(path: Path) -> Path:
    """A new random token in a new file ``path`` that only this user can read (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
    return path


@contextmanager
def deployment_security(args: argparse.Namespace) -> Iterator[DeploymentSecurity]:
    """:meth:`DeploymentSecurity.from_args`, with a random internal token made for this
    deployment when it brings no internal credentials and ``--no-internal-auth`` is off: in a
    0600 file of a new 0700 temporary directory, removed when the block ends. The token itself
    never goes on a command line; the services get its file's path."""
    given = DeploymentSecurity.from_args(args)
    if given.internal_auth or getattr(args, "no_internal_auth", False):
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as d:
        yield replace(given, token_file=write_token(Path(d) / TOKEN_FILE_NAME))
