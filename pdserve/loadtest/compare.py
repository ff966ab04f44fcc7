"""Comparison mode: one workload and one rate sweep (or, with ``--capacity``, a capacity
bisection) against two or more deployments, running routers (``--targets``) or ``pdserve up``
configurations started one after the other (``--launch``). Every deployment gets the same
requests and arrival times. Output: a markdown table, a JSON file and PNG plots.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdserve.loadtest import arrivals, capacity, datasets, metrics, phases, ports, procs, schedule, up_layout
from pdserve.loadtest.runner import (
    RunOptions,
    Workload,
    check_phases,
    git_commit,
    host_info,
    model_info,
    opts_from_args,
    parse_concurrency,
    result_stem,
    run_config,
    run_point,
    run_sweep,
    sweep_points,
    warmup,
    workload,
    write_json,
)

log = logging.getLogger(__name__)


def default_up_configs(gpus: str) -> list[tuple[str, str]]:
    """(a) disaggregated 1 prefill + 1 decode, (b) co-located 2 workers of role both."""
    ids = [g for g in gpus.split(",") if g.strip()]
    a, b = "--prefill 1 --decode 1", "--prefill 0 --decode 2 --role both"
    if ids:
        a += f" --prefill-gpus {ids[0]} --decode-gpus {ids[1] if len(ids) > 1 else ids[0]}"
        b += f" --decode-gpus {','.join(ids[:2])}"
    return [("disagg", a), ("colocated", b)]


def parse_targets(spec: str) -> list[tuple[str, str]]:
    out = []
    for i, item in enumerate(x.strip() for x in spec.split(",") if x.strip()):
        name, sep, addr = item.partition("=")
        out.append((name, addr) if sep else (f"target{i + 1}", item))
    if len(out) < 2:
        raise ValueError("--targets needs at least two NAME=HOST:PORT entries")
    return out


def _up_counts(up_args: str) -> argparse.Namespace:
    """The worker layout of a `pdserve up` command line (``--gpus`` laid out as ``up`` does)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--role", default="decode")
    for flag in ("--prefill-gpus", "--decode-gpus", "--extra-router-args", "--extra-decode-args"):
        p.add_argument(flag, default="")
    p.add_argument("--device", default="cpu")
    up_layout.add_layout_arguments(p)
    args = p.parse_known_args(shlex.split(up_args))[0]
    up_layout.apply(args)
    return args


def expected_workers(up_args: str) -> tuple[int, int]:
    """(prefill-capable, decode-capable) workers a `pdserve up` command line starts."""
    a = _up_counts(up_args)
    return a.prefill + (a.decode if a.role == "both" else 0), a.decode


def expected_processes(up_args: str) -> int:
    """Processes of a `pdserve up` group: itself, the router, the workers (one a rank)."""
    a = _up_counts(up_args)
    return (2 + a.prefill * up_layout.tensor_parallel_size(a, "prefill")
            + a.decode * up_layout.tensor_parallel_size(a, "decode"))


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown_table(series: Sequence[tuple[str, Sequence[dict[str, Any]]]], p_hi: str = "p99") -> str:
    head = ("| rate (req/s) | deployment | completed | failed | req/s | goodput (req/s) | output tok/s | "
            f"TTFT mean / {p_hi} (ms) | TPOT mean / {p_hi} (ms) | ITL mean (ms) | E2E mean / {p_hi} (ms) |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    num_points = max(len(r) for _, r in series)
    for i in range(num_points):
        for name, results in series:
            if i >= len(results):
                continue
            r = results[i]
            rate = r["request_rate"] if isinstance(r["request_rate"], str) else f"{r['request_rate']:g}"
            if r.get("max_concurrency"):
                rate += f" (conc {r['max_concurrency']})"
            lines.append(
                f"| {rate} | {name} | {r['completed']} | {r['failed']} | {_fmt(r['request_throughput'], 2)} | "
                f"{_fmt(r.get('request_goodput'), 2)} | {_fmt(r['output_throughput'])} | "
                f"{_fmt(r['mean_ttft_ms'])} / {_fmt(r.get(f'{p_hi}_ttft_ms'))} | "
                f"{_fmt(r['mean_tpot_ms'], 2)} / {_fmt(r.get(f'{p_hi}_tpot_ms'), 2)} | {_fmt(r['mean_itl_ms'], 2)} | "
                f"{_fmt(r['mean_e2el_ms'])} / {_fmt(r.get(f'{p_hi}_e2el_ms'))} |")
    return "\n".join(lines)


CAPACITY_KEYS = ("slo_attainment", "itl_p99_ms", "itl_p99_ok", "request_throughput", "request_goodput",
                 "p90_ttft_ms", "p90_tpot_ms")


def capacity_point(res: dict[str, Any], min_attainment: float) -> tuple[bool, dict[str, Any]]:
    """Whether a run held (as a whole: ``capacity.holds``) and what the search keeps of it; a
    phased run also keeps each phase's attainment (``phases.attainment``)."""
    info = {k: res[k] for k in CAPACITY_KEYS if k in res}
    if "phases" in res:
        info["phases"] = phases.attainment(res["phases"], min_attainment)
    return capacity.holds(res, min_attainment), info


def run_capacity(address: str, requests: Workload, opts, search: capacity.CapacitySearch,
                 name: str, on_point) -> tuple[capacity.Capacity, list[dict]]:
    """The bisection of one deployment's SLO capacity, its k-th run (from 1) on ``requests(k, rate)``;
    every run's result, by rate."""
    results: list[dict] = []

    def run(rate: float) -> tuple[bool, dict[str, Any]]:
        k = len(results) + 1
        res, _ = run_point(address, requests(k, rate), rate, None, opts, desc=f"{name} rate {rate:g}", variant=k)
        results.append(res)
        results.sort(key=lambda r: r["request_rate"])
        on_point(results, None)
        return capacity_point(res, search.min_attainment)

    cap = capacity.find_capacity(search, run)
    print(f"[{name}] SLO capacity {cap.capacity:g} req/s" + ("" if cap.bounded else " (lower bound)"), flush=True)
    return cap, results


_Config = tuple[str, str | None, str | None]   # (name, router address or None, `pdserve up` flags or None)


def _capacity_search(args: argparse.Namespace, opts: RunOptions) -> capacity.CapacitySearch | None:
    """The ``--capacity`` bisection asked for, if any (it needs per-request SLOs)."""
    try:
        search = capacity.search_from_args(args) if getattr(args, "capacity", False) else None
    except ValueError as e:
        raise SystemExit(f"--capacity: {e}") from None
    if search is not None and not [k for k in opts.slo if k not in metrics.RUN_SLOS]:
        raise SystemExit("--capacity needs per-request SLOs: --slo ttft_ms=..,tpot_ms=..[,itl_p99_ms=..]")
    return search


def _deployment_configs(args: argparse.Namespace) -> list[_Config]:
    """The deployments to compare: running routers (``--targets``) or `pdserve up` flags (``--launch``)."""
    if args.targets:
        return [(n, a, None) for n, a in parse_targets(args.targets)]
    ups = [tuple(c.split("=", 1)) for c in args.up_config] or default_up_configs(args.gpus)
    if any(len(u) != 2 for u in ups):
        raise SystemExit("--up-config takes NAME='pdserve up flags'")
    return [(n, None, a) for n, a in ups]


def _payload(args: argparse.Namespace, opts: RunOptions) -> dict[str, Any]:
    """The JSON file's header; the deployments, tables and plots are added as they come."""
    return {
        "benchmark": "pdserve bench compare", "label": args.label or args.dataset,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": " ".join(sys.argv),
        "commit": git_commit(), "host": host_info(), "config": run_config(args), "options": asdict(opts),
        "deployments": []}


def _wait_up(svc: procs.Service, address: str, up_args: str, timeout: float) -> None:
    """Until the router of a `pdserve up` deployment reports all its workers; raises if one of its
    processes exits first."""
    n_pre, n_dec = expected_workers(up_args)
    n_procs = expected_processes(up_args)

    def check() -> None:
        if not svc.alive() or len(svc.tree_pids()) < n_procs:
            raise RuntimeError(f"a process of `pdserve up` ({svc.name}) exited; its log "
                               f"{svc.log_path}:\n{svc.log_tail(40)}")

    procs.wait_ready([svc], timeout)
    procs.wait_workers(address, n_pre, n_dec, timeout, check)


@contextlib.contextmanager
def _deployment(args: argparse.Namespace, config: _Config, log_dir: Path) -> Iterator[str]:
    """The router address of one deployment: the one given, or that of a `pdserve up` started here,
    with all its workers, and stopped on leaving."""
    name, address, up_args = config
    svc = None
    try:
        if up_args is not None:
            rport = args.router_port or ports.free_port()
            full = f"--model {args.model} --device {args.device} {up_args} {args.up_args} " \
                   f"--startup-timeout {args.startup_timeout}"
            svc = procs.pdserve_up(rport, ports.free_port_range(16), shlex.split(full), log_dir, name).start()
            address = f"127.0.0.1:{rport}"
            print(f"[{name}] pdserve up {full} (router {address}; log {svc.log_path})", flush=True)
            _wait_up(svc, address, up_args, args.startup_timeout)
        assert address is not None
        yield address
    finally:
        if svc is not None:
            svc.stop(timeout=60)


def _measure(address: str, requests: Workload, name: str,
             points: Sequence[tuple[float, int | None]], opts: RunOptions, search: capacity.CapacitySearch | None,
             checkpoint: Callable[[list[dict], Any], None]) -> tuple[list[dict], capacity.Capacity | None]:
    """One deployment's rate sweep, or its capacity bisection: every run's result, and the capacity."""
    if search is None:
        results, _ = run_sweep(address, requests, points, opts, checkpoint, label=name)
        return results, None
    cap, results = run_capacity(address, requests, opts, search, name, checkpoint)
    return results, cap


def _tables(payload: dict[str, Any], series: Sequence[tuple[str, Sequence[dict[str, Any]]]],
            capacities: Sequence[tuple[str, capacity.Capacity]], opts: RunOptions,
            search: capacity.CapacitySearch | None) -> str:
    """The markdown report (after a search, the capacity table first), also put in ``payload``."""
    p_hi = "p" + metrics.percentile_key(max(opts.percentiles, default=99.0))
    table = markdown_table(series, p_hi)
    payload["table_markdown"] = table
    if search is not None and capacities:     # capacities come only from a search
        payload["capacity_markdown"] = capacity.markdown(capacities, opts.slo, search.min_attainment)
        table = payload["capacity_markdown"] + "\n\n" + table
    return table


def _plots(payload: dict[str, Any], series: Sequence[tuple[str, Sequence[dict[str, Any]]]],
           capacities: Sequence[tuple[str, capacity.Capacity]], stem: Path, opts: RunOptions,
           search: capacity.CapacitySearch | None) -> None:
    """The goodput plot (and, after a search, the capacity plot), named in ``payload``."""
    from pdserve.loadtest import plots
    metric = "request_goodput" if opts.slo else "request_throughput"
    png = plots.goodput_compare(series, stem.parent / f"{stem.name}_goodput.png",
                                f"{payload['label']}: " + " vs ".join(n for n, _ in series), metric)
    payload["plots"] = {"goodput": png.name}
    if search is not None and capacities:
        cpng = plots.capacity_compare(capacities, stem.parent / f"{stem.name}_capacity.png",
                                      f"{payload['label']}: SLO capacity", search.min_attainment)
        payload["plots"]["capacity"] = cpng.name


def _first_rate(points: Sequence[tuple[float, int | None]], search: capacity.CapacitySearch | None) -> float:
    """The rate of the first run: the warm-up and the dataset summary use the schedule at that rate."""
    if search is None:
        return points[0][0]
    return search.bracket[0] if search.bracket is not None else min(search.rates)


def run_compare(args: argparse.Namespace) -> int:
    """``pdserve bench compare``."""
    if bool(args.targets) == bool(args.launch):
        raise SystemExit("pdserve bench compare: give either --targets or --launch")
    opts = opts_from_args(args)
    search = _capacity_search(args, opts)
    points = sweep_points(arrivals.parse_rates(args.request_rate), parse_concurrency(args.max_concurrency))
    check_phases(args, [r for r, _ in points] if search is None else [])
    configs = _deployment_configs(args)
    stem = result_stem(args, prefix="compare")
    json_path = stem.parent / f"{stem.name}.json"
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-compare-"))
    payload = _payload(args, opts)
    requests: Workload | None = None
    first: list[datasets.BenchRequest] = []      # the warm-up's requests (run 0 at the first rate)
    series: list[tuple[str, list[dict]]] = []
    capacities: list[tuple[str, capacity.Capacity]] = []
    for config in configs:
        name, _, up_args = config
        with _deployment(args, config, log_dir) as address:
            info = model_info(address, args.ready_timeout)
            if requests is None:
                requests = workload(args, info, opts)
                sched0 = requests(0, _first_rate(points, search))
                payload["dataset"], first = schedule.summary(sched0), sched0.requests
            warmup(address, first, args.num_warmups, opts.request_timeout)
            dep: dict[str, Any] = {"name": name, "router": address, "up_args": up_args, "model_info": info,
                                   "results": []}
            payload["deployments"].append(dep)

            def checkpoint(results, samples, dep=dep) -> None:
                dep["results"] = results
                write_json(json_path, payload)

            results, cap = _measure(address, requests, name, points, opts, search, checkpoint)
            if cap is not None:
                dep["capacity"] = cap.as_dict()
                capacities.append((name, cap))
            series.append((name, results))
    table = _tables(payload, series, capacities, opts, search)
    if not args.no_plots:
        _plots(payload, series, capacities, stem, opts, search)
    write_json(json_path, payload)
    (stem.parent / f"{stem.name}.md").write_text(table + "\n")
    print(table)
    print(f"results: {json_path}")
    return 0
