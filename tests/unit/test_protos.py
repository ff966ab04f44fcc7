"""The generated stubs in pdserve/v1 are up to date with protos/ and import cleanly.

CI catches stale stubs here: ``scripts/gen_protos.py --check`` regenerates into a temp dir
and fails when the committed files differ (run ``make proto`` to fix).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_up_to_date() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_import_and_describe_the_contract() -> None:
    from pdserve.v1 import common_pb2, common_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

    assert common_pb2.DESCRIPTOR.package == "pdserve.v1"
    services = {
        "InfoService": (common_pb2, ["Info"]),
        "Generation": (router_pb2, ["Generate", "GenerateUnary", "Tokenize", "GetModelInfo"]),
        "Worker": (worker_pb2, ["Reserve", "Prefill", "PushKV", "Submit", "Subscribe",
                                "Cancel", "GetStats", "StreamKvEvents", "RenewLeases"]),
    }
    for name, (module, methods) in services.items():
        service = module.DESCRIPTOR.services_by_name[name]
        assert [m.name for m in service.methods] == methods
    for grpc_module, name in [(common_pb2_grpc, "InfoService"), (router_pb2_grpc, "Generation"),
                              (worker_pb2_grpc, "Worker")]:
        assert hasattr(grpc_module, f"{name}Stub")
        assert hasattr(grpc_module, f"add_{name}Servicer_to_server")
    # Every enum has a zero *_UNSPECIFIED value.
    for module in (common_pb2, router_pb2, worker_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name


def test_messages_round_trip() -> None:
    from pdserve.v1 import common_pb2, router_pb2, worker_pb2

    req = router_pb2.GenerateRequest(
        text="hi", params=common_pb2.SamplingParams(temperature=0.6, top_k=-1, seed=7,
                                                    max_tokens=4, stop=["\n"]))
    back = router_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("input") == "text" and back.params.HasField("seed")
    assert not back.HasField("add_special_tokens")  # unset = the per-input default
    resp = worker_pb2.PrefillResponse(first_token=worker_pb2.FirstToken(token_id=5))
    assert resp.WhichOneof("event") == "first_token"
    events = worker_pb2.KvEvents(stored=[2**64 - 1], evicted=[0])
    assert worker_pb2.KvEvents.FromString(events.SerializeToString()).stored == [2**64 - 1]
