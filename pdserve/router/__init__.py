"""The router: pdserve's public gRPC API in front of prefill and decode workers.

Modules, one concept each: ``main`` (flags, wiring), ``servicer`` (protobuf in/out),
``tokenization`` / ``validation`` (inputs, sampling params), ``flow`` (one request end to end),
``output`` (detokenization and stop strings), ``workers`` / ``worker_client`` (registry, health,
load, DNS), ``subscription`` (per-worker output streams), ``prefix_index`` and ``policy``
(where a request goes), ``metrics`` (Prometheus).
"""
