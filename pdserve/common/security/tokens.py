"""Bearer tokens: a file of accepted tokens (one per line, ``#`` comments), re-read when it
changes, checked in constant time. Used by the gRPC auth interceptor and the HTTP API.
"""
from __future__ import annotations

import hmac
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SCHEME = "bearer"
# Anything longer is not a token we issued; refuse before comparing.
MAX_TOKEN_BYTES = 4096


def _read_tokens(path: Path) -> tuple[bytes, ...]:
    tokens: list[bytes] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(line.encode()) > MAX_TOKEN_BYTES:
            raise ValueError(f"{path}: a token is longer than {MAX_TOKEN_BYTES} bytes")
        tokens.append(line.encode())
    if not tokens:
        raise ValueError(f"{path}: no tokens (one token per line expected)")
    return tuple(tokens)


def parse_bearer(header: str | None) -> bytes | None:
    """The token of an ``authorization`` value ``"Bearer <token>"`` or None when malformed."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != SCHEME or not token:
        return None
    raw = token.encode("utf-8", errors="replace")
    return raw if len(raw) <= MAX_TOKEN_BYTES else None


class BearerTokens:
    """The accepted tokens; :meth:`check` compares an ``authorization`` value against each."""

    def __init__(self, tokens: tuple[bytes, ...] | list[str], path: Path | None = None) -> None:
        values = tuple(t.encode() if isinstance(t, str) else t for t in tokens)
        if not values or any(not t for t in values):
            raise ValueError("BearerTokens needs at least one non-empty token")
        self._tokens = values
        self._path = path
        self._stamp = _file_stamp(path) if path is not None else None
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BearerTokens:
        """Tokens from ``path`` (one per line). Raises ValueError when unreadable or empty."""
        p = Path(path)
        try:
            tokens = _read_tokens(p)
        except OSError as e:
            raise ValueError(f"cannot read tokens file {p}: {e}") from e
        return cls(tokens, path=p)

    def __len__(self) -> int:
        return len(self._tokens)

    def first_token(self) -> str:
        """The file's first token: the one a client sends (the others are accepted too, so
        a new token can be rolled out before the old one is removed)."""
        return self._tokens[0].decode()

    def _maybe_reload(self) -> None:
        """Re-read the file when it changed; keep the old tokens when the new file is bad."""
        if self._path is None:
            return
        stamp = _file_stamp(self._path)
        if stamp is None or stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                self._tokens = _read_tokens(self._path)
                log.info("tokens file %s re-read (%d tokens)", self._path, len(self._tokens))
            except (OSError, ValueError) as e:
                log.warning("tokens file %s changed but cannot be used (%s); keeping %d tokens",
                            self._path, e, len(self._tokens))
            self._stamp = stamp

    def check_token(self, token: bytes | str | None) -> bool:
        """Whether a bare token is accepted (constant time in the token's content)."""
        if not token:
            return False
        raw = token.encode("utf-8", errors="replace") if isinstance(token, str) else token
        self._maybe_reload()
        ok = False
        for accepted in self._tokens:  # no early exit: every token is compared
            ok |= hmac.compare_digest(raw, accepted)
        return ok

    def check(self, authorization_header_value: str | None) -> bool:
        """Whether ``"Bearer <token>"`` carries an accepted token (False when absent/malformed)."""
        return self.check_token(parse_bearer(authorization_header_value))


def _file_stamp(path: Path) -> tuple[int, int] | None:
    """(mtime, size) of ``path``, None when it cannot be read now."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
