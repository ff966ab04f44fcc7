"""What a failed ``pdserve`` command tells the user: one line on stderr and an exit code.

A domain error (PdserveError, ValueError, grpc.RpcError) becomes ``pdserve <command>: <STATUS>:
<message> (<what to do>)``; anything else keeps its traceback (``--debug``: always). Exit codes:
2 wrong flag or field, 3 service unreachable / port busy / not ready, 4 deadline, 1 other,
130 interrupted.
"""
from __future__ import annotations

import grpc

EXIT_FAILURE = 1
EXIT_INVALID = 2
EXIT_UNAVAILABLE = 3
EXIT_DEADLINE = 4
EXIT_INTERRUPTED = 130

# status name -> (exit code, what to do)
_BY_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (EXIT_INVALID, "fix the flag or field named above; --help lists the ranges"),
    "UNAVAILABLE": (EXIT_UNAVAILABLE, "start the services (`pdserve up`) or pass --router ADDRESS"),
    "DEADLINE_EXCEEDED": (EXIT_DEADLINE, "raise --timeout or ask for fewer tokens"),
    "RESOURCE_EXHAUSTED": (EXIT_FAILURE, "the service is full: retry later or ask for fewer tokens"),
    "NOT_FOUND": (EXIT_FAILURE, "check the name or path named above"),
    "FAILED_PRECONDITION": (EXIT_FAILURE, "the service cannot do this in its current state"),
    "UNAUTHENTICATED": (EXIT_FAILURE, "pass the token the service expects"),
    "PERMISSION_DENIED": (EXIT_FAILURE, "pass the token the service expects"),
    "CANCELLED": (EXIT_FAILURE, "the request was cancelled"),
}
_DEFAULT = (EXIT_FAILURE, "run again with --debug for the traceback")
_BIND_HINT = "another process uses the port: pass another --port (pdserve up: --base-port, --router-port)"


def describe(exc: BaseException) -> tuple[str, str] | None:
    """(status name, message) of a domain error; None for anything else (a bug)."""
    from pdserve.common.grpc_utils.errors import PdserveError, from_rpc_error
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        exc = from_rpc_error(exc)
    if isinstance(exc, PdserveError):
        return exc.code.name, exc.message or type(exc).__name__
    if isinstance(exc, ValueError):
        return "INVALID_ARGUMENT", str(exc) or "invalid argument"
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return "NOT_FOUND", str(exc)
    if isinstance(exc, TimeoutError):
        return "UNAVAILABLE", str(exc) or "timed out"
    return None


def error_line(command: str, status: str, message: str) -> str:
    """``pdserve <command>: <STATUS>: <message> (<what to do>)``, on one line."""
    flat = " ".join(message.split())
    if "pass another --" in flat:       # the message already names the flag to change
        return f"pdserve {command}: {status}: {flat}"
    hint = _BIND_HINT if "cannot bind" in flat else _BY_STATUS.get(status, _DEFAULT)[1]
    return f"pdserve {command}: {status}: {flat} ({hint})"


def exit_code(status: str) -> int:
    return _BY_STATUS.get(status, _DEFAULT)[0]
