"""The router's flags of the prefill-placement policy (pdserve.router.pd_policy), with env defaults."""
from __future__ import annotations

import argparse

from pdserve.common import env
from pdserve.router.pd_policy import PdConfig
from pdserve.router.placement_policies import check_name


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    d = PdConfig()
    g = p.add_argument_group("prefill placement (pdserve.router.pd_policy)")
    g.add_argument("--pd-policy", type=_policy_name, default=env.get("ROUTER_PD_POLICY", d.mode),
                   help="the placement policy (pdserve/router/placement_policies.py): adaptive: per request, "
                        "prefill on the decode worker (local) or on another worker (remote), whichever keeps the "
                        "SLOs with more headroom; always: remote whenever a prefill-capable worker is up; never: "
                        "always local; fleet (the default): the decode worker and the prefill worker both chosen "
                        "per request from all workers (workers of role both), decodes that move; or "
                        "package.module:Class (env PDSERVE_ROUTER_PD_POLICY)")
    g.add_argument("--slo-ttft-ms", type=float, default=env.get_float("ROUTER_SLO_TTFT_MS", d.slo_ttft_ms),
                   help="time-to-first-token objective the policy keeps (env PDSERVE_ROUTER_SLO_TTFT_MS)")
    g.add_argument("--slo-tpot-ms", type=float, default=env.get_float("ROUTER_SLO_TPOT_MS", d.slo_tpot_ms),
                   help="time-per-output-token objective the policy keeps (env PDSERVE_ROUTER_SLO_TPOT_MS)")
    g.add_argument("--pd-local-max-tokens", type=int,
                   default=env.get_int("ROUTER_PD_LOCAL_MAX_TOKENS", d.local_max_tokens),
                   help="prompts with at most this many tokens uncached on their decode worker are prefilled "
                        "there (env PDSERVE_ROUTER_PD_LOCAL_MAX_TOKENS)")
    g.add_argument("--pd-remote-overhead-ms", type=float,
                   default=env.get_float("ROUTER_PD_REMOTE_OVERHEAD_MS", d.remote_overhead_ms),
                   help="fixed TTFT cost of a remote prefill: Reserve + PushKV round trips "
                        "(env PDSERVE_ROUTER_PD_REMOTE_OVERHEAD_MS)")
    g.add_argument("--pd-transfer-us-per-token", type=float,
                   default=env.get_float("ROUTER_PD_TRANSFER_US_PER_TOKEN", d.transfer_us_per_token),
                   help="KV transfer time per prompt token shipped (env PDSERVE_ROUTER_PD_TRANSFER_US_PER_TOKEN)")
    g.add_argument("--pd-rate-window-s", type=float,
                   default=env.get_float("ROUTER_PD_RATE_WINDOW_S", d.rate_window_s),
                   help="time constant of the prompt tokens a worker was given lately: its prefill rate "
                        "(local vs remote) and its recent work (which prefill worker) "
                        "(env PDSERVE_ROUTER_PD_RATE_WINDOW_S)")
    g.add_argument("--pd-move-interval-s", type=float,
                   default=env.get_float("ROUTER_PD_MOVE_INTERVAL_S", d.move_interval_s),
                   help="--pd-policy fleet: how often running decodes may be moved off a worker whose decode "
                        "rows alone break the TPOT objective (pdserve.router.fleet_policy); 0 = never "
                        "(env PDSERVE_ROUTER_PD_MOVE_INTERVAL_S)")


def _policy_name(name: str) -> str:
    try:
        return check_name(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def pd_config_from_args(args: argparse.Namespace) -> PdConfig:
    d = PdConfig()
    return PdConfig(mode=getattr(args, "pd_policy", d.mode), slo_ttft_ms=getattr(args, "slo_ttft_ms", d.slo_ttft_ms),
                    slo_tpot_ms=getattr(args, "slo_tpot_ms", d.slo_tpot_ms),
                    local_max_tokens=getattr(args, "pd_local_max_tokens", d.local_max_tokens),
                    remote_overhead_ms=getattr(args, "pd_remote_overhead_ms", d.remote_overhead_ms),
                    transfer_us_per_token=getattr(args, "pd_transfer_us_per_token", d.transfer_us_per_token),
                    rate_window_s=getattr(args, "pd_rate_window_s", d.rate_window_s),
                    move_interval_s=getattr(args, "pd_move_interval_s", d.move_interval_s))
