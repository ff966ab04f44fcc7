"""`pdserve up`'s deployment security, planned without starting anything: the internal and
public flags each service gets by role, the per-deployment token, flag errors, and the warning
for an unauthenticated internal port beyond loopback."""
from __future__ import annotations

import pytest

from tests.security_grpc import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _up(*flags: str):
    from pdserve import cli
    return cli.build_parser().parse_args(["up", *flags])


def _value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_up_passes_security_flags_by_role(pki):
    """Every service gets the internal flags (a worker: its port and its channels to other
    workers; the router: its channels to workers), the router also the public tokens; user extras
    come after them; up's own calls use each port's credentials."""
    from pdserve.cli import cmd_up
    cert, key = pki["server"]
    args = _up("--internal-token-file", str(pki["tokens"]), "--internal-tls-cert", str(cert),
               "--internal-tls-key", str(key), "--internal-tls-ca", str(pki["ca"].path),
               "--internal-tls-server-name", "pdserve-internal", "--auth-tokens-file", str(pki["tokens"]),
               "--extra-router-args=--reflection off")
    *workers, router = cmd_up.plan(args)
    internal = {"--internal-token-file": str(pki["tokens"]), "--internal-tls-cert": str(cert),
                "--internal-tls-key": str(key), "--internal-tls-ca": str(pki["ca"].path),
                "--internal-tls-server-name": "pdserve-internal"}
    for child in (*workers, router):
        assert {flag: _value(child.cmd, flag) for flag in internal} == internal, child.name
    assert all("--auth-tokens-file" not in w.cmd for w in workers)
    assert _value(router.cmd, "--auth-tokens-file") == str(pki["tokens"])
    assert router.cmd.index("--reflection") > router.cmd.index("--auth-tokens-file")     # extras win
    assert all(w.client.tls is not None and w.client.server_name == "pdserve-internal" for w in workers)
    assert router.client.tls is None and router.client.token_file == pki["tokens"]     # the public port
    plain = cmd_up.plan(_up("--no-internal-auth"))
    assert not [f for c in plain for f in c.cmd if f.startswith(("--internal-", "--auth-tokens"))]


def test_up_makes_a_token_per_deployment(pki):
    """Without internal credentials `up` makes a random token (a 0600 file in a 0700 directory,
    removed at the end) that every service gets by its path, never on a command line; not with
    --no-internal-auth, nor when mutual TLS is given."""
    from pdserve.cli import cmd_up
    from pdserve.common.security.deployment import deployment_security
    args = _up()
    with deployment_security(args) as first, deployment_security(args) as second:
        path = first.token_file
        assert path is not None and second.token_file is not None
        token = path.read_text().strip()
        assert len(token) >= 32 and token != second.token_file.read_text().strip()
        assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
        children = cmd_up.plan(args, first)
        assert all(_value(c.cmd, "--internal-token-file") == str(path) for c in children)
        assert not [c for c in children if any(token in part for part in c.cmd)]
        assert children[0].client.token_file == path and children[-1].client.token_file is None
    assert not path.exists() and not path.parent.exists()
    with deployment_security(_up("--no-internal-auth")) as off:
        assert off.token_file is None and not off.internal_auth
    cert, key = pki["server"]
    with deployment_security(_up("--internal-tls-cert", str(cert), "--internal-tls-key", str(key),
                                 "--internal-tls-ca", str(pki["ca"].path))) as mtls:
        assert mtls.token_file is None and mtls.tls is not None


def test_up_security_flag_errors(pki, tmp_path):
    from pdserve.common.security.deployment import DeploymentSecurity
    cert, key = pki["server"]
    for flags in (["--no-internal-auth", "--internal-token-file", str(pki["tokens"])],
                  ["--no-internal-auth", "--internal-tls-cert", str(cert), "--internal-tls-key", str(key),
                   "--internal-tls-ca", str(pki["ca"].path)],
                  ["--internal-tls-cert", str(cert), "--internal-tls-key", str(key)],
                  ["--internal-tls-server-name", "x"],
                  ["--internal-token-file", str(tmp_path / "missing")],
                  ["--auth-tokens-file", str(tmp_path / "missing")]):
        with pytest.raises(ValueError):
            DeploymentSecurity.from_args(_up(*flags))


def test_open_internal_port_beyond_loopback_warns_once(pki, caplog):
    import argparse
    import logging

    from pdserve.common.security.args import add_internal_arguments, internal_server_security
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    add_internal_arguments(parser)

    def warnings(*flags: str) -> int:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pdserve.common.security.args"):
            internal_server_security(parser.parse_args(list(flags)))
        return len([r for r in caplog.records if r.levelno == logging.WARNING])

    assert warnings("--host", "0.0.0.0") == 1
    assert warnings("--host", "10.1.2.3") == 1
    assert warnings("--host", "127.0.0.1") == warnings("--host", "localhost") == warnings("--host", "::1") == 0
    assert warnings("--host", "0.0.0.0", "--internal-token-file", str(pki["tokens"])) == 0
