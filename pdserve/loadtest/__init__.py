"""``pdserve bench serve``: a gRPC load generator for the router and the metrics of its runs
(docs/benchmarks.md)."""
