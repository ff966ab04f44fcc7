"""The prefill worker: batched prefill with its own prefix cache, first token, KV export."""
