"""Guided decoding (structured outputs) with xgrammar: a request's ``Guide`` (JSON Schema, any
JSON object, regex, choice, EBNF grammar) becomes a grammar compiled against the model's
vocabulary, and each guided Sequence gets a matcher that fills its row of the step's token
bitmask (pdserve.common.layers.token_mask) and accepts every token the sequence keeps.

``grammar`` (checking a guide; no torch, imported by the router through the converter) and
``state`` (compiling it and the per-sequence state; the engine's) are imported by name: this
package imports neither, so the router never loads the engine side. xgrammar itself is
imported only when a guide is used: unguided serving never loads it.
"""
