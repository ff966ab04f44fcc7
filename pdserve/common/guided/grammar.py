"""A ``Guide`` as an xgrammar Grammar (no tokenizer needed): the one place that knows how each
kind of guide is written in xgrammar's terms, used to check a request at the door and to compile
it in the engine.
"""
from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from pdserve.common.sampling_params import Guide, InvalidParameter

if TYPE_CHECKING:
    import xgrammar

MAX_GUIDE_CHARS = 1 << 20        # a schema, regex or grammar of at most 1 MiB of text
CHECKED_GUIDES = 256
# JSON may be laid out freely (models pretty-print it), but a run of whitespace between two
# JSON tokens is at most this long: a sampled model could otherwise spend its whole budget on
# newlines, which every grammar allows (seen with the embedded model at temperature 0.8).
MAX_JSON_WHITESPACE = 16


def field_name(guide: Guide) -> str:
    """The request field an error about ``guide`` names (``guide.json_schema``, ...)."""
    return f"guide.{guide.kind}"


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of ``choices`` (each escaped literally)."""
    return "(" + "|".join(_escape(c) for c in choices) + ")"


def _escape(text: str) -> str:
    """``text`` as a literal in xgrammar's (ECMAScript-like) regex syntax."""
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}/-" else ch for ch in text)


def to_grammar(guide: Guide) -> xgrammar.Grammar:
    """The xgrammar Grammar of ``guide``; raises InvalidParameter naming the guide's field when
    its schema, regex or grammar is malformed or too long."""
    import xgrammar as xgr

    name = field_name(guide)
    text = guide.value if guide.kind != "choice" else choice_regex(guide.choices)
    if len(text) > MAX_GUIDE_CHARS:
        raise InvalidParameter(name, f"is {len(text)} characters long; at most {MAX_GUIDE_CHARS}")
    try:
        if guide.kind == "json_schema":
            return xgr.Grammar.from_json_schema(_schema_text(guide.value, name), strict_mode=True,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if guide.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if guide.kind in ("regex", "choice"):
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except InvalidParameter:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
        raise InvalidParameter(name, f"cannot be compiled: {_short(e)}") from e


def check_guide(guide: Guide | None) -> None:
    """Raise InvalidParameter (naming ``guide.<kind>``) unless ``guide`` compiles; None passes.
    Guides that passed are remembered (the last ``CHECKED_GUIDES``): clients repeat them."""
    if guide is not None:
        _check_once(guide)


@functools.lru_cache(maxsize=CHECKED_GUIDES)
def _check_once(guide: Guide) -> bool:
    to_grammar(guide)           # raises: errors are not cached
    return True


def _schema_text(value: str, name: str) -> str:
    """The schema as JSON text; it must be a JSON object (or true)."""
    try:
        schema: Any = json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidParameter(name, f"is not valid JSON: {e}") from e
    if not isinstance(schema, dict) and schema is not True:
        raise InvalidParameter(name, f"must be a JSON object, got {type(schema).__name__}")
    return value if isinstance(schema, dict) else "{}"


def _short(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg
