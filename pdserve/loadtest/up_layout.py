"""``pdserve up --gpus 0,1,...``: one worker per GPU, laid out by ``--placement``.

- ``colocated``: every GPU a worker of role ``both`` that prefills its own requests in chunks of
  COLOCATED_BUDGET tokens beside its decode rows, router ``--pd-policy never``;
- ``disagg``: the first half of the GPUs prefill workers, the rest decode workers, router
  ``--pd-policy always`` (the static split);
- ``fleet`` (the default): every GPU a worker of role ``both`` (no TPOT guard: on H100 it cost
  goodput) with co-location's budget in steps with decode rows and FLEET_BUDGET in steps without
  (``--max-mixed-batched-tokens``), router ``--pd-policy fleet`` (pdserve/router/fleet_policy.py:
  co-location's pick first, a lean worker that prefills for the others while prefill dominates,
  decodes that move); measured at 0.94x the better static deployment on prefill-heavy and
  ``phases`` on 2 x H100 (bench/notes/placement.md, "Fourth session").

Flags given through ``--extra-*-args`` come after these, so they win. ``--gpus`` lays the workers
out itself: with ``--prefill``, ``--decode``, ``--role``, ``--prefill-gpus`` or ``--decode-gpus``
it is a usage error (SystemExit naming them).

Tensor parallelism: ``--tensor-parallel-size N`` (``-tp``) splits every worker over N GPUs,
``--prefill-tensor-parallel-size`` / ``--decode-tensor-parallel-size`` one side's; a worker then
takes N consecutive GPUs of its list (worker i of a side: GPUs ``iN .. iN + N - 1``), and
``--gpus`` makes one worker per N GPUs of its side.
"""
from __future__ import annotations

import argparse

PLACEMENTS = ("colocated", "disagg", "fleet")
DEFAULT_PLACEMENT = "fleet"
COLOCATED_BUDGET = 512          # prompt tokens a co-located step carries beside its decode rows
FLEET_BUDGET = 8192             # a fleet worker's step without decode rows (prefill-sized)
_LAYOUT_DEFAULTS = {"prefill": 1, "decode": 1, "role": "decode", "prefill_gpus": "", "decode_gpus": ""}


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", default="",
                   help="comma list of GPU ids: one worker per GPU, laid out by --placement (implies "
                        "--device cuda; replaces --prefill, --decode, --role, --prefill-gpus, --decode-gpus)")
    p.add_argument("--placement", choices=PLACEMENTS, default=DEFAULT_PLACEMENT,
                   help="with --gpus: colocated (every GPU prefills and decodes its own requests, chunked), "
                        "disagg (half the GPUs prefill, half decode) or fleet (every GPU serves both phases, "
                        "the router places each request's prefill and decode; the default)")


    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs (ranks) every worker is split over: tensor parallelism (default 1)")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=0,
                   help="the prefill workers' tensor-parallel size (default: --tensor-parallel-size)")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=0,
                   help="the decode (or both) workers' tensor-parallel size (default: --tensor-parallel-size)")


def tensor_parallel_size(args: argparse.Namespace, kind: str) -> int:
    """The tensor-parallel size of ``kind``'s workers (prefill or decode)."""
    side = getattr(args, f"{kind}_tensor_parallel_size", 0) or getattr(args, "tensor_parallel_size", 1)
    if side < 1:
        raise SystemExit(f"pdserve up: the {kind} workers' tensor-parallel size must be >= 1, got {side}")
    return side


def worker_gpus(gpus: str, index: int, tp: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of worker ``index`` of a side over ``gpus`` (a comma list; None: no
    list): its ``tp`` consecutive GPUs, the list taken round."""
    ids = [g for g in gpus.split(",") if g]
    return ",".join(ids[(index * tp + k) % len(ids)] for k in range(tp)) if ids else None


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """SystemExit when a side's tensor-parallel size is not a size. Any pair of sizes may ship KV
    (each prefill rank sends its KV heads straight to the decode ranks that hold them)."""
    for kind in ("prefill", "decode"):
        tensor_parallel_size(args, kind)


def _workers(ids: list[str], tp: int, what: str) -> int:
    if len(ids) % tp:
        raise SystemExit(f"pdserve up: {len(ids)} GPUs for the {what} workers cannot be split into workers of "
                         f"{tp} (tensor-parallel size)")
    return len(ids) // tp


def apply(args: argparse.Namespace) -> None:
    """Rewrite ``args``' worker layout for ``--gpus`` (nothing without it; once: a second call on
    the same ``args`` changes nothing)."""
    ids = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if not ids or getattr(args, "_layout_applied", False):
        return
    args._layout_applied = True
    given = [f"--{k.replace('_', '-')}" for k, v in _LAYOUT_DEFAULTS.items() if getattr(args, k) != v]
    if given:
        raise SystemExit(f"pdserve up: --gpus lays the workers out itself; drop {', '.join(given)} or --gpus")
    if args.device == "cpu":
        args.device = "cuda"
    n, router, decode_extra = len(ids), "", ""
    if args.placement == "disagg":
        if n < 2:
            raise SystemExit("pdserve up: --placement disagg needs two GPUs or more in --gpus")
        half = n // 2
        args.prefill = _workers(ids[:half], tensor_parallel_size(args, "prefill"), "prefill")
        args.decode = _workers(ids[half:], tensor_parallel_size(args, "decode"), "decode")
        args.prefill_gpus, args.decode_gpus = ",".join(ids[:half]), ",".join(ids[half:])
        router = "--pd-policy always"
    else:
        args.prefill, args.role, args.decode_gpus = 0, "both", ",".join(ids)
        args.decode = _workers(ids, tensor_parallel_size(args, "decode"), "co-located")
        if args.placement == "colocated":
            router = "--pd-policy never"
            if not hasattr(args, "max_num_batched_tokens"):
                decode_extra = f"--max-num-batched-tokens {COLOCATED_BUDGET}"
        else:
            router = "--pd-policy fleet"
            decode_extra = f"--max-num-batched-tokens {FLEET_BUDGET} --max-mixed-batched-tokens {COLOCATED_BUDGET}"
    args.extra_router_args = f"{router} {args.extra_router_args}".strip()
    args.extra_decode_args = f"{decode_extra} {args.extra_decode_args}".strip()
