"""Code shared by the router and the workers: engine, model, layers, ops, KV transfer, config."""
