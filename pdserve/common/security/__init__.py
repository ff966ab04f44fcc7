"""Transport security and authentication of pdserve's services (docs/design.md, "Security"):
bearer tokens (:mod:`.tokens`), TLS files (:mod:`.tls`), the auth interceptors (:mod:`.auth`),
per-port and per-process settings (:mod:`.config`), their flags (:mod:`.args`), and a whole
``pdserve up`` deployment's (:mod:`.deployment`: its flags, its per-deployment internal token).
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
