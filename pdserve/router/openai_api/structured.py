"""Structured outputs of a request body -> ``pdserve.v1.Guide`` (guided decoding).

``response_format``: ``{"type": "text"}`` (no guide), ``{"type": "json_object"}``, or
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (what
the openai SDK's ``chat.completions.parse(response_format=<a Pydantic model>)`` sends). vLLM's
extras: ``guided_json`` (a schema object or its JSON text), ``guided_regex``, ``guided_choice``
(a list of strings), ``guided_grammar`` (EBNF). At most one of them. Only the JSON shape is
checked here; whether the schema, regex or grammar compiles is the request path's check, whose
error (``params.guide.<kind>``) is renamed to the field given here (``GuideRequest.param``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.router.openai_api import fields
from pdserve.router.openai_api.errors import bad_request
from pdserve.v1 import common_pb2

VLLM_EXTRAS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class GuideRequest:
    """The request's guide and the body field it came from (named in errors)."""

    guide: common_pb2.Guide
    param: str


def parse_guide(body: dict) -> GuideRequest | None:
    """The guide the body asks for, or None (free text); a 400 naming the field otherwise."""
    found = [g for g in (_response_format(body), *(_extra(body, name) for name in VLLM_EXTRAS)) if g is not None]
    if len(found) > 1:
        raise bad_request(found[1].param, f"only one of response_format and {', '.join(VLLM_EXTRAS)} may be set "
                                          f"(also got {found[0].param})")
    return found[0] if found else None


def _response_format(body: dict) -> GuideRequest | None:
    fmt = fields.obj(body, "response_format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuideRequest(common_pb2.Guide(json_object=True), "response_format")
    if kind != "json_schema":
        raise bad_request("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = fields.obj(fmt, "json_schema")
    if spec is None:
        raise bad_request("response_format.json_schema", "is required when type is json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema", "must be a JSON Schema object")
    fields.string(spec, "name")
    return GuideRequest(common_pb2.Guide(json_schema=json.dumps(schema)), "response_format.json_schema.schema")


def _extra(body: dict, name: str) -> GuideRequest | None:
    value = body.get(name)
    if value is None:
        return None
    if name == "guided_json":
        if isinstance(value, str):
            return GuideRequest(common_pb2.Guide(json_schema=value), name)
        if not isinstance(value, dict):
            raise bad_request(name, "must be a JSON Schema (an object or its JSON text)")
        return GuideRequest(common_pb2.Guide(json_schema=json.dumps(value)), name)
    if name == "guided_choice":
        choices = fields.string_list(body, name)
        return GuideRequest(common_pb2.Guide(choice=common_pb2.GuideChoices(choices=choices)), name)
    text = fields.string(body, name) or ""
    guide = common_pb2.Guide(regex=text) if name == "guided_regex" else common_pb2.Guide(grammar=text)
    return GuideRequest(guide, name)
