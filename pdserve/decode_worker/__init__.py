"""The decode worker: KV import, paged cache, continuous batching, token streams."""
