"""The FP8 KV cache across a transfer, on the CPU with Gloo and a tiny preset: a prefill and a
decode worker both with ``--kv-cache-dtype fp8`` give the outputs of one co-located fp8 worker
token for token, ship FP8 blocks (a quarter of the float32 model's bytes), and leave every pool
whole; a Reserve from a prefill worker of another cache dtype is refused with
FAILED_PRECONDITION naming both dtypes."""
from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from bench import deployment
from bench.disagg_gpu import compare, pools_whole, run_all
from pdserve.common.loader import PRESET_DIR
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

FP8 = ["--kv-cache-dtype", "fp8", "--dtype", "float32", "--max-model-len", "512"]
PROMPT_LEN, BLOCK_SIZE = 48, 16          # three whole blocks a prompt, no prefix shared between prompts


def _fp8_block_bytes() -> int:
    c = json.loads((PRESET_DIR / "tiny-qwen3.json").read_text())
    return c["num_hidden_layers"] * 2 * BLOCK_SIZE * c["num_key_value_heads"] * c["head_dim"]


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    (root / "disagg").mkdir()
    (root / "both").mkdir()
    common = dict(model="tiny-qwen3", device="cpu", kv_memory_gb=0.02, extra_worker_args=FP8)
    no_admission = ["--admission-slo-multiple", "0"]
    disagg = deployment.start(root / "disagg", router_args=[*no_admission, "--pd-policy", "always"], **common)
    try:
        both = deployment.start(root / "both", num_prefill=0, decode_role="both", router_args=no_admission, **common)
    except BaseException:
        disagg.stop()
        raise
    yield disagg, both
    disagg.stop()
    both.stop()


def test_disaggregated_fp8_equals_colocated_fp8(deployments):
    disagg, both = deployments
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT_LEN)] for _ in range(12)]
    a = asyncio.run(run_all(disagg.router, prompts, 8))
    b = asyncio.run(run_all(both.router, prompts, 8))
    eq = compare(a, b)
    assert eq["identical"] == eq["requests"] == 12 and all(isinstance(x[0], list) for x in a), eq
    pools = {**pools_whole(disagg), **pools_whole(both)}
    assert all(p["free"] == p["total"] for p in pools.values()), pools
    decode = pools[disagg.decode[0]]
    assert decode["transfers"] == 12, pools
    assert decode["transfer_bytes"] == 12 * (PROMPT_LEN // BLOCK_SIZE) * _fp8_block_bytes()   # 1 byte an element
    for addr in (disagg.decode[0], disagg.prefill[0]):
        with grpc.insecure_channel(addr) as ch:
            info = common_pb2_grpc.InfoServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=10)
        assert info.kv_cache_dtype == "float8_e4m3fn"


def test_reserve_from_another_cache_dtype_is_refused(deployments):
    disagg, _ = deployments
    with grpc.insecure_channel(disagg.decode[0]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerStub(ch).Reserve(worker_pb2.ReserveRequest(
                request_id="fp8-mismatch", token_ids=list(range(1, 40)), router_id="any",
                params=common_pb2.SamplingParams(max_tokens=4), kv_cache_dtype="float32"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "float32" in err.value.details() and "float8_e4m3fn" in err.value.details()
