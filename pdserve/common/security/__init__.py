"""Transport security and authentication of pdserve's services (docs/design.md, "Security").

- :mod:`.tokens`: bearer tokens from a file, constant-time checks (gRPC and HTTP);
- :mod:`.tls`: TLS files, server credentials re-read when the files change, client credentials;
- :mod:`.auth`: the server interceptor (tokens or a verified client certificate; health open)
  and the client interceptor that sends a token;
- :mod:`.config`: what a port (:class:`ServerSecurity`) and a process's channels to workers
  (:class:`ClientSecurity`) apply;
- :mod:`.args`: the flags and their ``PDSERVE_*`` environment defaults.

The KV pair channel's rendezvous secret lives with the channel (pdserve/common/kv_transfer/channel.py).
"""
from pdserve.common.security.config import (
                                    ClientSecurity,
                                    ServerSecurity,
                                    default_client_security,
                                    set_default_client_security,
)
from pdserve.common.security.tls import TlsFiles
from pdserve.common.security.tokens import BearerTokens

__all__ = ["BearerTokens", "ClientSecurity", "ServerSecurity", "TlsFiles",
           "default_client_security", "set_default_client_security"]
