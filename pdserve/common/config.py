"""Frozen, validated configuration: the model's geometry and the engine's limits."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}

KV_CACHE_DTYPES = ("auto", "fp8")           # vLLM's --kv-cache-dtype names (fp8 = e4m3)
QUANTIZATIONS = (None, "fp8")               # vLLM's --quantization names


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"dtype: unknown {name!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (HF ``rope_type: llama3``, Llama-3.1 / 3.2 / 3.3).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their
    frequency, those longer than ``original_max_position_embeddings / low_freq_factor`` have it
    divided by ``factor``, and those between are interpolated smoothly (layers/rotary.py).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling: factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling: need 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"rope_scaling: original_max_position_embeddings must be >= 1, "
                             f"got {self.original_max_position_embeddings}")


def _rope_scaling_from_hf(d: dict) -> RopeScaling | None:
    """The rope scaling of an HF ``config.json``: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (4.x). None for the default rope; a ValueError naming any type other than
    ``default`` / ``llama3``, or a llama3 block missing a field."""
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    block = rope if (rope.get("rope_type") or rope.get("type")) else scaling
    rope_type = block.get("rope_type") or block.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling: type {rope_type!r} is not supported (default, llama3)")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if block.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling: type 'llama3' needs {', '.join(missing)}")
    # as transformers: a top-level original_max_position_embeddings wins, then the block's
    original = (d.get("original_max_position_embeddings") or block.get("original_max_position_embeddings")
                or d.get("max_position_embeddings", 4096))
    return RopeScaling(factor=float(block["factor"]), low_freq_factor=float(block["low_freq_factor"]),
                       high_freq_factor=float(block["high_freq_factor"]),
                       original_max_position_embeddings=int(original))


@dataclass(frozen=True)
class ModelConfig:
    """The decoder geometry read from an HF ``config.json`` (Llama / Qwen2 / Qwen3)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool          # q/k/v projections have a bias (Qwen2; Llama if set)
    o_bias: bool                  # o_proj has a bias (Llama with attention_bias)
    mlp_bias: bool
    qk_norm: bool                 # RMSNorm on q and k per head (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    name: str = "model"
    rope_scaling: RopeScaling | None = None    # None = the default rope (no scaling)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):    # from dataclasses.asdict (a rank's spec)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {self.model_type!r} is not supported "
                             f"({', '.join(SUPPORTED_MODEL_TYPES)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, in ``torch_dtype``."""
        elt = torch.tensor([], dtype=parse_dtype(self.torch_dtype)).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elt

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "model") -> ModelConfig:
        model_type = d.get("model_type", "llama")
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}
        rope_scaling = _rope_scaling_from_hf(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(d.get("attention_bias", model_type == "qwen2"))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type == "llama",
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32").replace("torch.", ""),
            name=name,
            rope_scaling=rope_scaling,
        )

    @classmethod
    def from_file(cls, path: Path, name: str | None = None) -> ModelConfig:
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), name or Path(path).parent.name)


def check_step_limits(max_num_seqs: int, max_num_batched_tokens: int, max_num_partial_prefills: int,
                      long_prefill_token_threshold: int) -> None:
    """A ValueError naming the first of one engine step's limits out of range: the first three
    must be >= 1, ``long_prefill_token_threshold`` >= 0 (0 = no cap). The engine's config and
    the scheduler's both check them."""
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_partial_prefills", max_num_partial_prefills)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if long_prefill_token_threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0 (0 = no cap), got {long_prefill_token_threshold}")


def check_mixed_budget(max_mixed_batched_tokens: int, max_num_batched_tokens: int) -> None:
    """A ValueError unless ``0 <= max_mixed_batched_tokens <= max_num_batched_tokens`` (0 = the
    step budget: a step with decode rows is budgeted as any other)."""
    if not 0 <= max_mixed_batched_tokens <= max_num_batched_tokens:
        raise ValueError(f"max_mixed_batched_tokens must be in [0, max_num_batched_tokens = "
                         f"{max_num_batched_tokens}] (0 = the step budget), got {max_mixed_batched_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    """Limits and placement of one engine (one worker or one offline ``LLM``).

    The field defaults are the engine's defaults everywhere: the workers' flags and ``pdserve up``
    read them here (pdserve.common.serving.worker_args).
    """

    model: str = "default"                  # checkpoint dir, preset (pdserve/common/presets), "default" = embedded
    dtype: str = "auto"                     # "auto" = checkpoint dtype on GPU, float32 on CPU
    device: str = "auto"                    # "auto" = cuda if available, else cpu
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None        # None = the model's max_position_embeddings, capped
    num_kv_blocks: int | None = None        # explicit pool size; None = sized from memory
    kv_cache_memory_gb: float | None = None # memory for the KV pool; None = fraction below
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    enforce_eager: bool = False             # no CUDA graphs
    tensor_parallel_size: int = 1           # ranks (processes, GPUs) the model is split over (engine/ranks.py)
    seed: int = 0                           # dummy-weight seed (presets / configs)
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None    # overlap host work with the GPU; None = with CUDA graphs
    warmup: bool = True                     # CUDA: compile every kernel variant before serving
    enable_chunked_prefill: bool = True     # mixed steps: decode rows + prompt chunks under one budget
    max_num_partial_prefills: int = 1       # prompts partly prefilled at once (chunked prefill)
    long_prefill_token_threshold: int = 0   # cap on one prompt's chunk per step; 0 = no cap
    max_mixed_batched_tokens: int = 0       # budget of a step with decode rows; 0 = max_num_batched_tokens
    tpot_target_ms: float = 0.0             # TPOT guard (engine/tpot_guard.py); 0 = only per-request targets
    tpot_margin: float = 0.05               # share of the TPOT target the guard keeps free
    extra: dict = field(default_factory=dict)
    kv_cache_dtype: str = "auto"            # "auto" = the model's dtype; "fp8" = e4m3 (docs/design.md, FP8)
    quantization: str | None = None         # None = the checkpoint's weights as they are; "fp8"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must name a checkpoint directory or a preset")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        check_step_limits(self.max_num_seqs, self.max_num_batched_tokens, self.max_num_partial_prefills,
                          self.long_prefill_token_threshold)
        check_mixed_budget(self.max_mixed_batched_tokens, self.max_num_batched_tokens)
        if self.tpot_target_ms < 0:
            raise ValueError(f"tpot_target_ms must be >= 0 (0 = off), got {self.tpot_target_ms}")
        if not 0.0 <= self.tpot_margin < 1.0:
            raise ValueError(f"tpot_margin must be in [0, 1), got {self.tpot_margin}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(str(q) for q in QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for ``--kv-cache-dtype`` ``name``: the model's dtype for
    "auto", ``torch.float8_e4m3fn`` for "fp8"; ValueError for any other name."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as torch spells it without the module: "bfloat16", "float8_e4m3fn"."""
    return str(dtype).removeprefix("torch.")
