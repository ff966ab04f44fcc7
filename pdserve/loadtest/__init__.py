"""``pdserve bench serve``: a gRPC load generator for the router and the metrics of its runs.

Modules: :mod:`.datasets` (workloads), :mod:`.arrivals` (arrival times), :mod:`.client` (the
asyncio load generator, one or several processes), :mod:`.metrics` (vLLM's serving metrics),
:mod:`.runner` (a sweep over request rates: JSON + PNG), :mod:`.compare` (two deployments side
by side), :mod:`.router_overhead` (the router alone, on scripted workers). See
docs/benchmarks.md.
"""
