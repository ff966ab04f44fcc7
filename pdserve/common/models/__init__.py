"""The decoder family (Llama / Qwen2 / Qwen3) and its checkpoint-name mapping."""
