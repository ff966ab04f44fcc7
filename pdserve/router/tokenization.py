"""The router's view of the model (name, context, vocabulary, tokenizer) and prompt building.

:func:`resolve_spec` follows :func:`pdserve.common.loader.resolve_model`'s rules without importing
torch. A plain ``tokenizer.json`` tokenizer loads through ``PreTrainedTokenizerFast``, any other
class through ``AutoTokenizer``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.common.grpc_utils import InvalidArgument

log = logging.getLogger(__name__)

PRESET_DIR = Path(__file__).resolve().parents[1] / "common" / "presets"
DEFAULT_ALIASES = ("default", "SmolLM2-135M-Instruct", "smollm2-135m-instruct")
_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend", None)
NO_LENGTH_LIMIT = int(1e30)   # transformers' own "no limit" value of model_max_length
# Roles accepted in chat input besides those the chat template names literally.
KNOWN_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@dataclass(frozen=True)
class ModelSpec:
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer_dir: Path | None = None
    extra: dict = dataclasses.field(default_factory=dict, compare=False)


def _spec_from_config(path: Path, name: str, tokenizer_dir: Path | None) -> ModelSpec:
    d = json.loads(Path(path).read_text())
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelSpec(name=name, max_model_len=int(d.get("max_position_embeddings", 4096)),
                     vocab_size=int(d["vocab_size"]), eos_token_ids=tuple(int(e) for e in eos_ids),
                     tokenizer_dir=tokenizer_dir)


def resolve_spec(model: str) -> ModelSpec:
    """The router's view of ``model``; FileNotFoundError naming the problem otherwise."""
    if model in DEFAULT_ALIASES:
        from pdserve.common.default_model import ensure_default_model
        path = ensure_default_model()
        return _spec_from_config(path / "config.json", path.name, path)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {path} has no config.json")
        has_tok = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
        return _spec_from_config(path / "config.json", path.name, path if has_tok else None)
    if path.suffix == ".json" and path.is_file():
        return _spec_from_config(path, path.stem, None)
    preset = PRESET_DIR / f"{model}.json"
    if preset.is_file():
        return _spec_from_config(preset, model, None)
    presets = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.json")))
    raise FileNotFoundError(f"model: {model!r} is neither a checkpoint directory nor a preset "
                            f"(presets: {presets}; or 'default' for the embedded model)")


class RouterTokenizer:
    """Text <-> token ids and chat rendering with the model's tokenizer."""

    def __init__(self, tokenizer_dir: Path) -> None:
        cfg_path = Path(tokenizer_dir) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        if (Path(tokenizer_dir) / "tokenizer.json").is_file() and cfg.get("tokenizer_class") in _FAST_CLASSES:
            from transformers import PreTrainedTokenizerFast
            self.hf: Any = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
        else:
            from transformers import AutoTokenizer
            self.hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.chat_template: str = self.hf.chat_template or ""
        # Lengths are checked against the model's context by the router (a clear INVALID_ARGUMENT),
        # not by the tokenizer, which would only log a warning per long prompt.
        self.hf.model_max_length = NO_LENGTH_LIMIT
        # The Rust tokenizer's own decode gives the same text when there is no clean-up pass.
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._fast_decode = (backend.decode if backend is not None
                             and not getattr(self.hf, "clean_up_tokenization_spaces", False) else None)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not ids:     # the incremental detokenizer's empty prefix at a request's first token
            return ""
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    def knows_role(self, role: str) -> bool:
        return role in KNOWN_CHAT_ROLES or f"'{role}'" in self.chat_template or f'"{role}"' in self.chat_template


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    field: str                  # the input field it came from (for error messages)
    rendered: str = ""          # chat only: the rendered template
    # The same ids as the client sent them (its request's repeated field), when it sent ids:
    # copied into a worker request as is (cheaper than converting the list back).
    # dataclasses.field: the name ``field`` is this class's attribute above
    wire: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def wire_ids(self) -> Any:
        return self.token_ids if self.wire is None else self.wire


def _need_tokenizer(tok: RouterTokenizer | None, spec: ModelSpec, field_name: str) -> RouterTokenizer:
    if tok is None:
        raise InvalidArgument(field_name, f"model {spec.name!r} has no tokenizer; send token_ids")
    return tok


def _chat_messages(chat: Any, tok: RouterTokenizer) -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidArgument("chat.messages", "no messages")
    out = []
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidArgument(f"chat.messages[{i}].role", "empty role")
        if not tok.knows_role(m.role):
            raise InvalidArgument(f"chat.messages[{i}].role",
                                  f"unknown role {m.role!r} (known: {', '.join(sorted(KNOWN_CHAT_ROLES))})")
        out.append({"role": m.role, "content": m.content})
    return out


def build_prompt(request: Any, tok: RouterTokenizer | None, spec: ModelSpec, vocab_size: int) -> Prompt:
    """Token ids of a GenerateRequest or TokenizeRequest's input (INVALID_ARGUMENT naming the
    field when it is missing, empty, untokenizable or out of the vocabulary)."""
    kind = request.WhichOneof("input")
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else None
    if kind is None:
        raise InvalidArgument("input", "exactly one of text, chat or token_ids must be set")
    if kind == "text":
        if not request.text:
            raise InvalidArgument("text", "prompt is empty")
        t = _need_tokenizer(tok, spec, "text")
        prompt = Prompt(t.encode(request.text, True if add_special is None else add_special), "text")
    elif kind == "chat":
        t = _need_tokenizer(tok, spec, "chat")
        if not t.has_chat_template:
            raise InvalidArgument("chat", f"model {spec.name!r} has no chat template; send text")
        messages = _chat_messages(request.chat, t)
        try:
            rendered = t.render_chat(messages, add_generation_prompt=not request.skip_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja errors (raise_exception in templates)
            raise InvalidArgument("chat", f"chat template failed: {e}") from e
        prompt = Prompt(t.encode(rendered, False if add_special is None else add_special), "chat", rendered)
    else:
        wire = request.token_ids.ids
        ids = wire[:]                 # a list (faster than list(wire))
        if ids and max(ids) >= vocab_size:
            i = next(i for i, tid in enumerate(ids) if tid >= vocab_size)
            raise InvalidArgument(f"token_ids.ids[{i}]", f"{ids[i]} is out of the vocabulary (size {vocab_size})")
        prompt = Prompt(ids, "token_ids.ids", wire=wire)
    if not prompt.token_ids:
        raise InvalidArgument(prompt.field, "prompt is empty (0 tokens)")
    return prompt


def check_context(prompt: Prompt, max_tokens: int, max_model_len: int) -> int:
    """The effective max_tokens (0 = fill the context); INVALID_ARGUMENT when it does not fit."""
    n = len(prompt.token_ids)
    if n >= max_model_len:
        raise InvalidArgument(prompt.field, f"prompt has {n} tokens; the model's context is "
                                            f"{max_model_len} (prompt + at least 1 output token)")
    if max_tokens == 0:
        return max_model_len - n
    if n + max_tokens > max_model_len:
        raise InvalidArgument("params.max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) "
                                                   f"is over the model's context ({max_model_len})")
    return max_tokens
