"""Command-line flags shared by the worker services, with PDSERVE_* environment defaults."""
from __future__ import annotations

import argparse
import socket
import uuid

from pdserve.common import env
from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine_args import (
    add_chunked_prefill_arguments,
    add_fp8_arguments,
    chunked_prefill_kwargs,
    fp8_kwargs,
)
from pdserve.common.kv_transfer import DEFAULT_TIMEOUT as KV_TIMEOUT_S
from pdserve.common.security.args import add_internal_arguments, internal_client_security, internal_server_security
from pdserve.common.security.config import ServerSecurity, set_default_client_security

# The engine's defaults are EngineConfig's (its field defaults); the flags below read them there.
ENGINE_DEFAULTS = EngineConfig()
# Default token budget per step (--max-num-batched-tokens 0). A prefill worker has no decode rows
# to stall, so it takes large steps (the offline engine's default); a decode or both worker takes
# vLLM's online-serving default, so a mixed step stays a few decode steps long (bench/NOTES.md).
DEFAULT_BUDGET = {"prefill": ENGINE_DEFAULTS.max_num_batched_tokens, "decode": 2048}
# With the TPOT guard on, a decode or both worker's budget is the ceiling of a step without
# decode rows (the guard sizes the others): large enough for the GEMMs to run at full rate, small
# enough that a KV import landing during it waits ~0.1 s on an 8B model, not a whole batch of prompts.
GUARDED_BUDGET = 4096
DEFAULT_DRAIN_GRACE_S = 30.0    # on SIGTERM: time for requests in flight to finish


def add_worker_arguments(p: argparse.ArgumentParser, default_port: int, default_metrics_port: int) -> None:
    d = ENGINE_DEFAULTS
    p.add_argument("--host", default=env.get("HOST", "0.0.0.0"), help="listen address (env PDSERVE_HOST)")
    p.add_argument("--port", type=int, default=env.get_int("PORT", default_port), help="gRPC port (env PDSERVE_PORT)")
    p.add_argument("--advertise-host", default=env.get("ADVERTISE_HOST", None),
                   help="host name other workers use to reach this one (default: this host's name)")
    p.add_argument("--metrics-port", type=int, default=env.get_int("METRICS_PORT", default_metrics_port),
                   help="Prometheus /metrics HTTP port, 0 = off (env PDSERVE_METRICS_PORT)")
    p.add_argument("--worker-id", default=env.get("WORKER_ID", None), help="default: host-port-random")
    p.add_argument("--model", default=env.get("MODEL", d.model),
                   help="checkpoint dir, preset name, or 'default' for the embedded model (env PDSERVE_MODEL)")
    p.add_argument("--device", default=env.get("DEVICE", d.device),
                   help="cpu, cuda, cuda:N or auto (env PDSERVE_DEVICE)")
    p.add_argument("--dtype", default=env.get("DTYPE", d.dtype), help="auto, float32, bfloat16, float16")
    p.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=env.get_int("TENSOR_PARALLEL_SIZE", d.tensor_parallel_size),
                   help="GPUs (processes on the CPU) the model is split over, one rank each: GPUs 0..N-1 of "
                        "those this process sees (env PDSERVE_TENSOR_PARALLEL_SIZE)")
    p.add_argument("--block-size", type=int, default=env.get_int("BLOCK_SIZE", d.block_size),
                   help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=env.get_int("NUM_KV_BLOCKS", 0),
                   help="KV pool size in blocks; 0 = from --kv-memory-gb or free memory")
    p.add_argument("--kv-memory-gb", type=float, default=env.get_float("KV_MEMORY_GB", 0.0),
                   help="memory for the KV pool in GiB; 0 = from free memory (GPU) or 1 GiB (CPU)")
    p.add_argument("--max-num-seqs", type=int, default=env.get_int("MAX_NUM_SEQS", d.max_num_seqs),
                   help="most sequences in one engine step (the running batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=env.get_int("MAX_NUM_BATCHED_TOKENS", 0),
                   help="token budget of one engine step; 0 = by role: "
                        f"{DEFAULT_BUDGET['prefill']} for prefill, {DEFAULT_BUDGET['decode']} for decode and both "
                        f"({GUARDED_BUDGET} with --tpot-target-ms, which then sizes steps with decode rows)")
    p.add_argument("--max-model-len", type=int, default=env.get_int("MAX_MODEL_LEN", 0), help="0 = model default")
    add_chunked_prefill_arguments(p)
    add_fp8_arguments(p)
    p.add_argument("--attention-backend", default=env.get("ATTENTION_BACKEND", d.attention_backend),
                   help="attention kernels: torch, triton, or auto (triton on CUDA, else torch)")
    p.add_argument("--enforce-eager", action="store_true", default=env.get_bool("ENFORCE_EAGER", d.enforce_eager),
                   help="no CUDA graphs")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default=env.get("ASYNC_SCHEDULING", "auto"),
                   help="overlap host work with the GPU (auto: on with CUDA graphs)")
    p.add_argument("--drain-grace-s", type=float, default=env.get_float("DRAIN_GRACE_S", DEFAULT_DRAIN_GRACE_S),
                   help="on SIGTERM: time to finish in-flight requests before cancelling them")
    p.add_argument("--kv-timeout-s", type=float, default=env.get_float("KV_TIMEOUT_S", KV_TIMEOUT_S),
                   help="timeout of one KV transfer")
    p.add_argument("--kv-transport", default=env.get("KV_TRANSPORT", "auto"),
                   help="KV transport, the same on every worker of a deployment: nccl, gloo, a registered name "
                        "(pdserve.common.kv_transfer.transport), or auto (nccl for a GPU pool, gloo for a CPU one) "
                        "(env PDSERVE_KV_TRANSPORT)")
    add_internal_arguments(p)


def worker_security(args: argparse.Namespace) -> ServerSecurity:
    """The worker port's security from the flags; also sets this process's channels to other
    workers (prefill -> decode PushKV) to the same internal credentials."""
    set_default_client_security(internal_client_security(args))
    return internal_server_security(args)


def engine_config_from_args(args: argparse.Namespace, role: str = "both") -> EngineConfig:
    budget = args.max_num_batched_tokens or default_budget(role, args.tpot_target_ms > 0)
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks or None, kv_cache_memory_gb=args.kv_memory_gb or None,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=args.max_model_len or None, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
        **chunked_prefill_kwargs(args), **fp8_kwargs(args),
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])


def default_budget(role: str, guarded: bool) -> int:
    """The token budget of a step when --max-num-batched-tokens is 0 (DEFAULT_BUDGET, GUARDED_BUDGET)."""
    if role == "prefill":
        return DEFAULT_BUDGET["prefill"]
    return GUARDED_BUDGET if guarded else DEFAULT_BUDGET["decode"]


def worker_id_from_args(args: argparse.Namespace, role: str) -> str:
    return args.worker_id or f"{role}-{socket.gethostname()}-{args.port}-{uuid.uuid4().hex[:6]}"


def advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_host:
        return args.advertise_host
    return "127.0.0.1" if args.host in ("127.0.0.1", "localhost") else socket.gethostname()
