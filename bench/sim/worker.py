"""A scripted worker with the scale simulation's modelled backend:

    python -m bench.sim.worker --role decode --port 41000 --time-scale 6 --num-blocks 2048 ...

The KV pool is the engine's own BlockManager (bench.sim.pool: true hits, evictions and events),
prefill takes the modelled time of its uncached tokens on a FIFO prefill GPU and decode steps
the modelled time of their batch (bench.sim.cost, stretched by ``--time-scale``); GetStats
fills the prefill backlog and context tokens; a prefill worker counts the pair channels it
would hold (bench.sim.channels). Every other flag is the scripted worker's.
"""
from __future__ import annotations

import argparse
import sys

from bench.sim.channels import ChannelBook
from bench.sim.cost import CostModel
from bench.sim.pool import ManagedPool
from bench.sim.prefill_gpu import PrefillGpu
from pdserve.loadtest import scripted_worker as sw


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-scale", type=float, default=1.0, help="every modelled time times this")
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="prefill batch budget")
    p.add_argument("--kv-max-channels", type=int, default=32, help="pair channels a prefill worker keeps")
    p.add_argument("--kv-idle-close-s", type=float, default=300.0, help="idle pair channels close after")


def make_parts(args: argparse.Namespace) -> sw.ModelledParts:
    cost = CostModel(scale=args.time_scale, max_batched_tokens=args.max_batched_tokens)
    return sw.ModelledParts(pool=ManagedPool(args.num_blocks, args.block_size), cost=cost, gpu=PrefillGpu(cost),
                            channels=ChannelBook(args.kv_max_channels, args.kv_idle_close_s))


def parse_args(argv: list[str]) -> argparse.Namespace:
    return sw.parse_args(argv, add_sim_arguments)


def main(argv: list[str] | None = None) -> int:
    return sw.main(argv, add_sim_arguments, make_parts)


if __name__ == "__main__":
    sys.exit(main())
