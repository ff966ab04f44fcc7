"""The first hour of a new user and operator, with real processes: ``pdserve up`` starts and
stops without an ERROR line or a traceback in any service's log, ``pdserve generate`` reports
how a request ended, a prompt the router refuses is one line on the client and a count in the
router's request metric, and reflection answers as v1 and v1alpha."""
from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from pdserve.cli import errors as cli_errors
from pdserve.common.grpc_utils.server import wait_ready
from pdserve.loadtest.ports import free_port, free_port_range
from pdserve.loadtest.procs import ROOT

STARTUP_S = 300


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def pdserve_together(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """``pdserve(*argv)`` for each of ``argvs``, all at once; their results in the same order."""
    with ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda argv: pdserve(*argv), argvs))


def assert_clean(log: str) -> None:
    """No ERROR line and no traceback (at any level) in a service log."""
    assert "Traceback" not in log, log
    assert not re.search(r"^\S+ \S+ ERROR ", log, re.M), log
    assert "Token indices sequence length" not in log, log


# ---- a router alone, serving a preset (no tokenizer) -----------------------------------------

@pytest.fixture(scope="module")
def preset_router(tmp_path_factory):
    port, metrics = free_port(), free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "router", "--host", "127.0.0.1",
                                 "--port", str(port), "--metrics-port", str(metrics), "--http-port", "0",
                                 "--model", "tiny-llama", "--startup-wait-s", "0"],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        asyncio.run(wait_ready(f"127.0.0.1:{port}", STARTUP_S))
        yield f"127.0.0.1:{port}", metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0
    assert_clean(log.read_text())


def test_text_prompt_to_a_model_without_tokenizer_is_one_line(preset_router):
    address, metrics_port = preset_router
    proc = pdserve("generate", "hello", "--router", address)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and proc.returncode == cli_errors.EXIT_INVALID, proc.stderr
    assert "INVALID_ARGUMENT" in lines[0] and "no tokenizer" in lines[0] and "token_ids" in lines[0]
    # the refused request is in the router's request metric, by status
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(r'^pdserve_router_requests_total\{method="Generate",status="INVALID_ARGUMENT"\} (\S+)$', text, re.M)
    assert m and float(m.group(1)) >= 1, text


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_v1_and_v1alpha(preset_router, version):
    address, _ = preset_router
    service = f"grpc.reflection.{version}.ServerReflection"
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/{service}/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        listed, described = call(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)]), timeout=10)
    names = {s.name for s in listed.list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health", service} <= names
    assert described.file_descriptor_response.file_descriptor_proto, described


# ---- pdserve up, start to stop ---------------------------------------------------------------

def test_up_starts_and_stops_quietly(tmp_path):
    base, router = free_port_range(4), free_port()
    log = tmp_path / "up.log"
    with log.open("w") as f:
        up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--base-port", str(base),
                               "--router-port", str(router), "--http-port", "0", "--num-kv-blocks", "256"],
                              cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        while "all services are SERVING" not in log.read_text():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        address = f"127.0.0.1:{router}"
        # the three clients together (each is seconds of Python start-up on the CPU); the last is
        # longer than the model's context: refused by the router, with no tokenizer warning in its log
        done, quiet, too_long = pdserve_together(
            ["generate", "Say hello.", "--router", address, "--max-tokens", "5"],
            ["generate", "Say hello.", "--router", address, "--max-tokens", "3", "--quiet"],
            ["generate", "word " * 9000, "--router", address, "--raw"])
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        assert re.fullmatch(r"\[finish_reason=length prompt_tokens=\d+ completion_tokens=5 cached_tokens=\d+\]\n",
                            done.stderr), done.stderr
        assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.strip()
        assert too_long.returncode == cli_errors.EXIT_INVALID and "INVALID_ARGUMENT" in too_long.stderr
        assert len(too_long.stderr.strip().splitlines()) == 1, too_long.stderr
    finally:
        up.send_signal(signal.SIGINT)       # Ctrl-C
        up.wait(90)
    text = log.read_text()
    assert up.returncode == 0, text
    assert_clean(text)
    assert "still loading its model" not in text
    for port in (base, base + 2):       # said once per worker, if the router was quicker
        assert text.count(f"waiting for worker 127.0.0.1:{port} to load its model") <= 1, text
    assert text.count("gRPC server on port") == 3, text     # every service stopped
