"""gRPC plumbing shared by every pdserve server and client (grpc.aio only; no engine imports)."""
from pdserve.common.grpc_utils.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PdserveError,
    PeerUnavailable,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
    status_for,
    unavailable_peer,
)
from pdserve.common.grpc_utils.interceptor import ErrorInterceptor
from pdserve.common.grpc_utils.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    GrpcServer,
    Service,
    build_server,
    client_channel,
    serve,
    wait_ready,
)

__all__ = [
    "AlreadyExists", "Cancelled", "DeadlineExceeded", "FailedPrecondition", "Internal",
    "InvalidArgument", "NotFound", "PdserveError", "PeerUnavailable", "ResourceExhausted", "Unavailable",
    "from_rpc_error", "status_for", "unavailable_peer", "ErrorInterceptor", "DEFAULT_MAX_MESSAGE_BYTES",
    "GrpcServer", "Service", "build_server", "client_channel", "serve", "wait_ready",
]
