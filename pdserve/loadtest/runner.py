"""A serving run = a workload + an arrival process + a rate; a sweep = one run per rate (and per
concurrency limit). A run sends the :class:`~pdserve.loadtest.schedule.Schedule` its workload
builds for it (requests and send offsets; metrics per phase too when the schedule has phases).
Writes ``<result-dir>/<name>.json`` (rewritten after every point) and two PNGs beside it
(latency CDFs, throughput and goodput against the rate).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.loadtest import arrivals, datasets, metrics, phases, schedule
from pdserve.loadtest.client import run_load
from pdserve.loadtest.schedule import Schedule, Workload

log = logging.getLogger(__name__)


@dataclass
class RunOptions:
    burstiness: float = 1.0
    seed: int = 0
    normalize_arrivals: bool = False
    percentiles: tuple[float, ...] = metrics.DEFAULT_PERCENTILES
    slo: dict[str, float] = field(default_factory=dict)
    itl_mode: str = "chunk"
    num_procs: int = 1
    channels_per_proc: int = 4
    request_timeout: float = 600.0
    disable_tqdm: bool = False
    save_detailed: bool = False
    quiet: bool = False
    http: Any = None    # pdserve.loadtest.openai_client.HttpTarget: the OpenAI HTTP API instead of gRPC


def git_commit() -> str:
    """HEAD, or ``PDSERVE_GIT_COMMIT`` where the tree has no .git (the device machines)."""
    from pdserve.common import env
    commit = env.get("GIT_COMMIT")
    if commit:
        return commit
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=Path(__file__).resolve().parents[2]).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def host_info() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "gpus": gpu_names()}


def gpu_names() -> list[str]:
    """``nvidia-smi -L`` lines (empty without NVIDIA GPUs); no CUDA import in the load generator."""
    try:
        out = subprocess.check_output(["nvidia-smi", "-L"], text=True, stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(" (UUID")[0] for line in out.splitlines() if line.strip()]


def model_info(router: str, timeout: float = 60.0) -> dict[str, Any]:
    """The router's GetModelInfo (retried until ``timeout``: the router may still be starting)."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from pdserve.v1 import router_pb2, router_pb2_grpc
    end = time.monotonic() + timeout
    last: Exception | None = None
    with grpc.insecure_channel(router.split(",")[0]) as ch:     # the first of several replicas
        stub = router_pb2_grpc.GenerationStub(ch)
        while time.monotonic() < end:
            try:
                info = stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=5.0, wait_for_ready=True)
                if info.num_decode_workers > 0:
                    return MessageToDict(info, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
                last = RuntimeError("the router reports no decode worker yet")
            except grpc.RpcError as e:
                last = e
            time.sleep(0.2)
    raise RuntimeError(f"router {router} not ready in {timeout:.0f} s: {last}")


def build_requests(args: argparse.Namespace, info: dict[str, Any], variant: int = 0) -> list[datasets.BenchRequest]:
    vocab = args.vocab_size or int(info.get("vocab_size") or 10000)
    requests = datasets.build(
        args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        vocab=vocab, seed=args.seed, prompt_format=args.prompt_format, dataset_path=args.dataset_path,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, temperature=args.temperature,
        num_turns=getattr(args, "num_turns", 4), variant=variant,
        ignore_eos=args.ignore_eos, max_model_len=int(info.get("max_model_len") or 0) or None)
    if getattr(args, "closed_loop_turns", False):
        if args.dataset != "multi-turn":
            raise ValueError("--closed-loop-turns needs --dataset multi-turn")
        requests = datasets.closed_loop(requests)
    return requests


def workload(args: argparse.Namespace, info: dict[str, Any], opts: RunOptions) -> Workload:
    """The schedules of the warm-up (``workload(0, rate)``) and of the k-th run of a sweep or
    capacity search (``workload(k, rate)``, k >= 1): variant k of the dataset (datasets module
    docstring), so that no run finds an earlier run's prompts cached (``--same-prompts``: variant 0
    for all), sent with the arrival process of ``opts`` at the rate; ``--dataset phases``: the
    phased run of pdserve/loadtest/phases.py at that base rate."""
    if args.dataset == "phases":
        vocab = args.vocab_size or int(info.get("vocab_size") or 10000)
        return phases.workload_from_args(args, vocab, int(info.get("max_model_len") or 0) or None)
    first = build_requests(args, info)

    def at(k: int, rate: float) -> Schedule:
        reqs = first if k == 0 or getattr(args, "same_prompts", False) else build_requests(args, info, variant=k)
        return schedule.spaced(reqs, rate, opts.burstiness, opts.seed, opts.normalize_arrivals)
    return at


def check_phases(args: argparse.Namespace, rates: Sequence[float]) -> None:
    """Refuses, before any deployment starts, ``--dataset phases`` with a flag it does not take
    (``phases.check_args``) or with a sweep over ``rates`` that is not finite (they are base rates)."""
    if args.dataset != "phases":
        return
    try:
        phases.check_args(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not all(math.isfinite(r) for r in rates):
        raise SystemExit("--dataset phases: --request-rate is the base rate of the phases and must be finite")


def sweep_points(rates: Sequence[float], concurrencies: Sequence[int | None]) -> list[tuple[float, int | None]]:
    return [(r, c) for c in concurrencies for r in rates]


def parse_concurrency(spec: str | None) -> list[int | None]:
    if not spec:
        return [None]
    out: list[int | None] = []
    for x in str(spec).split(","):
        x = x.strip().lower()
        if x in ("", "none", "0"):
            out.append(None)
        else:
            n = int(x)
            if n < 1:
                raise ValueError(f"max concurrency must be >= 1, not {x}")
            out.append(n)
    return out


def load(router: str, http: Any, requests: Sequence[datasets.BenchRequest], offsets: Collection[float],
         **kw: Any):
    """gRPC Generate streams to ``router`` (run_load), or the OpenAI HTTP API when ``http`` is set."""
    if http is None:
        return run_load(router, requests, offsets, **kw)
    from pdserve.loadtest import openai_client
    if any(r.after >= 0 for r in requests):
        raise ValueError("--closed-loop-turns is supported with the gRPC client only (not --http)")
    return openai_client.run_load(http, requests, offsets, max_concurrency=kw.get("max_concurrency"),
                                  timeout=kw.get("timeout"), pbar=kw.get("pbar"))


def warmup(router: str, requests: Sequence[datasets.BenchRequest], n: int, timeout: float, http: Any = None) -> None:
    """``n`` requests (the first of the workload, at most 16 output tokens) that must succeed."""
    if n <= 0 or not requests:
        return
    from dataclasses import replace
    req = replace(requests[0], output_len=min(requests[0].output_len, 16), after=-1)
    res = load(router, http, [req] * n, [0.0] * n, timeout=timeout, channels_per_proc=1)
    bad = [r for r in res.records if not r.success]
    if bad:
        raise RuntimeError(f"warm-up request failed: {bad[0].status} {bad[0].error}")


def run_point(router: str, sched: Schedule, rate: float, concurrency: int | None,
              opts: RunOptions, desc: str = "", variant: int = 0) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """One run of ``sched`` (built for ``rate``): its result dict (vLLM keys + config + client +
    the prompts' ``variant``; ``phases``, the same metrics per phase, when the schedule has
    phases) and latency samples."""
    requests, offsets = sched.requests, sched.offsets
    pbar = None
    if not opts.disable_tqdm:
        from tqdm import tqdm
        pbar = tqdm(total=len(requests), desc=desc or f"rate {arrivals.rate_label(rate)}", unit="req",
                    leave=True, file=sys.stderr)
    try:
        result = load(router, opts.http, requests, offsets, max_concurrency=concurrency, num_procs=opts.num_procs,
                      timeout=opts.request_timeout, channels_per_proc=opts.channels_per_proc, pbar=pbar)
    finally:
        if pbar is not None:
            pbar.close()
    res: dict[str, Any] = {"request_rate": arrivals.rate_label(rate) if math.isinf(rate) else rate,
                           "burstiness": opts.burstiness if not math.isinf(opts.burstiness) else "inf",
                           "max_concurrency": concurrency, "prompt_variant": variant}
    res.update(metrics.compute_metrics(result.records, result.duration, opts.percentiles, opts.slo or None,
                                       opts.itl_mode))
    if sched.windows:
        res["phases"] = phases.phase_metrics(result.records, sched, opts.percentiles, opts.slo or None, opts.itl_mode)
    res["client"] = result.client
    if result.client["max_cpu_util"] > 0.8:
        res["client_warning"] = (f"a client process used {result.client['max_cpu_util']:.0%} of a core: "
                                 "the client may limit this run (raise --num-client-procs)")
        log.warning("%s", res["client_warning"])
    if opts.save_detailed:
        res["detailed"] = metrics.detailed_lists(result.records, opts.itl_mode)
        res["detailed"]["extra"] = [r.extra for r in requests]      # e.g. conversation and turn
    if not opts.quiet:
        title = f" rate {arrivals.rate_label(rate)}" + (f", concurrency {concurrency}" if concurrency else "") + " "
        print(metrics.format_table(res, opts.percentiles, title=title), flush=True)
        if "phases" in res:
            print(phases.format_phases(res["phases"], opts.percentiles), flush=True)
    return res, metrics.latency_samples(result.records)


def run_sweep(router: str, requests: Workload, points: Sequence[tuple[float, int | None]],
              opts: RunOptions, on_point=None, label: str = "") -> tuple[list[dict], list[dict[str, list[float]]]]:
    """One run per point, the k-th (from 1) on ``requests(k)``."""
    results, samples = [], []
    for k, (rate, conc) in enumerate(points, start=1):
        desc = (f"{label} " if label else "") + f"rate {arrivals.rate_label(rate)}" + (f" conc {conc}" if conc else "")
        res, smp = run_point(router, requests(k, rate), rate, conc, opts, desc, variant=k)
        results.append(res)
        samples.append(smp)
        if on_point is not None:
            on_point(results, samples)
    return results, samples


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    return _redacted({k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                      for k, v in sorted(vars(args).items()) if not k.startswith("_") and not callable(v)})


def _redacted(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without secrets (an API key is never written into a result file)."""
    out = {k: (_redacted(v) if isinstance(v, dict) else v) for k, v in d.items()}
    if out.get("api_key"):
        out["api_key"] = "<redacted>"
    return out


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)
    return path


def write_plots(stem: Path, results: Sequence[dict], samples: Sequence[dict], title: str) -> dict[str, str]:
    from pdserve.loadtest import plots
    vary_conc = len({r["max_concurrency"] for r in results}) > 1 and len({r["request_rate"] for r in results}) == 1
    labels = [plots.point_label(r, vary_conc) for r in results]
    cdf = plots.latency_cdfs(list(zip(labels, samples)), stem.parent / f"{stem.name}_latency_cdf.png", title)
    thr = plots.throughput_vs_rate(results, stem.parent / f"{stem.name}_throughput.png", title, vary_conc)
    return {"latency_cdf": cdf.name, "throughput": thr.name}


def opts_from_args(args: argparse.Namespace) -> RunOptions:
    return RunOptions(
        burstiness=float(args.burstiness), seed=args.seed, normalize_arrivals=args.normalize_arrivals,
        percentiles=tuple(float(p) for p in str(args.percentiles).split(",") if p.strip()),
        slo=metrics.parse_slo([*(args.slo or []), *(args.goodput or [])]), itl_mode=args.itl_mode,
        num_procs=args.num_client_procs, channels_per_proc=args.channels_per_proc,
        request_timeout=args.request_timeout, disable_tqdm=args.disable_tqdm, save_detailed=args.save_detailed)


def result_stem(args: argparse.Namespace, prefix: str = "serve") -> Path:
    name = args.result_filename or f"{prefix}-{args.label or args.dataset}-" \
        f"{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    name = name[:-5] if name.endswith(".json") else name
    return Path(args.result_dir) / name


def run_serve(args: argparse.Namespace) -> int:
    """``pdserve bench serve``."""
    opts = opts_from_args(args)
    rates = arrivals.parse_rates(args.request_rate)
    check_phases(args, rates)
    points = sweep_points(rates, parse_concurrency(args.max_concurrency))
    target = args.router
    if getattr(args, "backend", "grpc") == "openai":
        from dataclasses import replace

        from pdserve.loadtest import openai_client
        info = openai_client.model_info(args.base_url, args.api_key, args.ready_timeout)
        opts = replace(opts, http=openai_client.HttpTarget(args.base_url, args.endpoint, info["model"], args.api_key))
        target = f"{args.base_url} ({args.endpoint})"
        if args.num_client_procs > 1:
            log.warning("--backend openai runs one client process; --num-client-procs %d is ignored",
                        args.num_client_procs)
    else:
        info = model_info(args.router, args.ready_timeout)
    requests = workload(args, info, opts)
    first = requests(0, rates[0])
    warmup(args.router, first.requests, args.num_warmups, opts.request_timeout, opts.http)
    stem = result_stem(args)
    json_path = stem.parent / f"{stem.name}.json"
    payload: dict[str, Any] = {
        "benchmark": "pdserve bench serve", "label": args.label or args.dataset,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": " ".join(sys.argv),
        "commit": git_commit(), "host": host_info(), "router": target, "model_info": info,
        "config": run_config(args), "options": _redacted(asdict(opts)), "dataset": schedule.summary(first),
        "results": []}

    def checkpoint(results, samples) -> None:
        payload["results"] = results
        write_json(json_path, payload)

    results, samples = run_sweep(args.router, requests, points, opts, checkpoint)
    if not args.no_plots:
        payload["plots"] = write_plots(stem, results, samples,
                                       f"{payload['label']} via {target} ({len(first.requests)} requests)")
    write_json(json_path, payload)
    print(f"results: {json_path}" + (f" (+ {', '.join(payload['plots'].values())})" if "plots" in payload else ""))
    return 0 if all(r["completed"] for r in results) else 1
