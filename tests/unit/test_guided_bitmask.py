"""The step bitmask of guided rows (pdserve.common.guided.bitmask): a grammar compiled against
the tokenizer's vocabulary gives, in a model's wider bitmask, exactly the mask of the same grammar
compiled at the model's width (padding ids forbidden, the tail of a partial word included); a
batch fill on several threads equals one fill per row; the reused buffer keeps nothing of an
earlier step; rows unguided, failed or terminated allow everything."""
from __future__ import annotations

import json
import random

import pytest
import torch

from pdserve.common.guided.bitmask import ROWS_PER_THREAD, StepBitmask, fill_threads
from pdserve.common.guided.state import GuideCompiler, GuideState, fill_bitmask
from pdserve.common.layers.token_mask import unpack_bitmask
from pdserve.common.sampling_params import Guide

xgr = pytest.importorskip("xgrammar")

# A tiny vocabulary of 40 tokens (not a multiple of 32: a partial last word); id 39 ends a grammar.
VOCAB = [c for c in "abcdefghij0123456789,:{}[]\" "] + ["ab", "ba", "12", "a1", "1a", "\"a", "a\"", "{\"", "\"}",
                                                       "xx", "</s>"]
EOS = len(VOCAB) - 1
MODEL_VOCAB = 100               # the model's logits: 60 ids past the tokenizer's vocabulary
REGEX = r"(a|b)+[0-9]{2,5}(ab|ba)*"


class Row:
    """A sequence as the bitmask reads it."""

    def __init__(self, guide: GuideState | None) -> None:
        self.guide = guide
        self.completion_token_ids: list[int] = []


def compiled(vocab_size: int, regex: str = REGEX):
    info = xgr.TokenizerInfo(VOCAB, vocab_size=vocab_size, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, max_threads=1).compile_grammar(xgr.Grammar.from_regex(regex))


def reference(matcher, vocab_size: int) -> torch.Tensor:
    """One row filled by a matcher of the model's width (what the engine did before)."""
    bm = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bm, 0)
    return bm[0]


def test_tokenizer_width_grammar_gives_the_model_width_mask():
    narrow, wide = compiled(len(VOCAB)), compiled(MODEL_VOCAB)
    rng = random.Random(0)
    rows = [Row(GuideState(narrow)) for _ in range(6)]
    refs = [xgr.GrammarMatcher(wide) for _ in rows]
    step = StepBitmask(MODEL_VOCAB)
    for _ in range(8):
        mask = step.fill(rows)
        assert mask is not None and mask.shape == (len(rows), 4)
        allowed = unpack_bitmask(mask, MODEL_VOCAB)
        for i, (row, ref) in enumerate(zip(rows, refs)):
            if row.guide is not None and row.guide.is_terminated:
                assert bool(allowed[i].all())
                continue
            assert torch.equal(mask[i], reference(ref, MODEL_VOCAB)), i
            assert not bool(allowed[i, len(VOCAB):].any())
            token = rng.choice(allowed[i].nonzero().flatten().tolist())
            row.completion_token_ids.append(token)
            assert ref.accept_token(token)


def test_padding_ids_from_outside_fail_the_grammar_and_free_the_row():
    """A token past the tokenizer's vocabulary (only possible from outside the sampler) is refused
    as before; the failed row, like an unguided one, allows everything."""
    rows = [Row(GuideState(compiled(len(VOCAB)))), Row(None), Row(GuideState(compiled(len(VOCAB))))]
    rows[0].completion_token_ids = [0, 70]
    mask = StepBitmask(MODEL_VOCAB).fill(rows)
    assert rows[0].guide.failed and not rows[2].guide.failed
    assert mask is not None and bool((mask[:2] == -1).all())
    assert not bool(unpack_bitmask(mask, MODEL_VOCAB)[2, len(VOCAB):].any())


def test_terminated_rows_allow_everything():
    state = GuideState(compiled(len(VOCAB), "ab"))
    row = Row(state)
    row.completion_token_ids = [VOCAB.index("ab"), EOS]
    mask = StepBitmask(MODEL_VOCAB).fill([row])
    assert state.is_terminated and mask is not None and bool((mask == -1).all())


def test_the_reused_buffer_keeps_nothing_of_an_earlier_step():
    g = compiled(len(VOCAB))
    step = StepBitmask(MODEL_VOCAB)
    first = step.fill([Row(GuideState(g)), Row(GuideState(g)), Row(GuideState(g))])
    assert first is not None and not bool((first == -1).all())
    fresh = step.fill([Row(None), Row(GuideState(g))])
    assert fresh is not None and bool((fresh[0] == -1).all())
    assert torch.equal(fresh[1], reference(xgr.GrammarMatcher(compiled(MODEL_VOCAB)), MODEL_VOCAB))
    assert step.fill([Row(None)]) is None and fill_bitmask([Row(None)], MODEL_VOCAB) is None
    assert torch.equal(fill_bitmask([Row(None), Row(GuideState(g))], MODEL_VOCAB), fresh)


def test_a_batch_on_several_threads_equals_one_fill_per_row():
    g = compiled(MODEL_VOCAB)      # the model's own width: filled in place, rows by index
    n = 3 * ROWS_PER_THREAD + 1
    rows = [Row(GuideState(g)) if i % 5 else Row(None) for i in range(n)]
    rng = random.Random(1)
    step = StepBitmask(MODEL_VOCAB)
    for _ in range(4):
        mask = step.fill(rows)
        assert mask is not None
        for i, row in enumerate(rows):
            if row.guide is None or row.guide.is_terminated:
                assert bool((mask[i] == -1).all())
                continue
            alone = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
            row.guide.matcher.fill_next_token_bitmask(alone, 0)
            assert torch.equal(mask[i], alone[0]), i
            row.completion_token_ids.append(rng.choice(unpack_bitmask(mask[i:i + 1], MODEL_VOCAB)[0]
                                                       .nonzero().flatten().tolist()))
    assert 1 <= fill_threads(n) <= 3 and fill_threads(ROWS_PER_THREAD - 1) == 1


def test_upload_off_cuda_is_the_mask_itself():
    step = StepBitmask(MODEL_VOCAB)
    mask = step.fill([Row(GuideState(compiled(len(VOCAB))))])
    assert mask is not None and torch.equal(step.upload(mask, torch.device("cpu")), mask)


def test_the_compiler_covers_the_tokenizer_not_the_model_padding():
    """The embedded model's tokenizer padded to a wider model (as a preset's): grammars cover the
    tokenizer's ids, and the step mask equals that of a grammar at the model's width."""
    from transformers import AutoTokenizer

    from pdserve.common.default_model import ensure_default_model
    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    width = len(tok) + 1000
    guide = Guide("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))
    compiler = GuideCompiler(tok, width, [tok.eos_token_id])
    assert compiler.grammar_vocab_size == len(tok)
    state = compiler.new_state(guide)
    assert state.vocab_size == len(tok)
    padded = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=width, stop_token_ids=[tok.eos_token_id])
    from pdserve.common.guided.grammar import to_grammar
    ref = xgr.GrammarMatcher(xgr.GrammarCompiler(padded, max_threads=1).compile_grammar(to_grammar(guide)))
    row = Row(state)
    step = StepBitmask(width)
    for text in ('{"n"', ': 1', '2}'):
        mask = step.fill([row])
        assert mask is not None and torch.equal(mask[0], reference(ref, width))
        for token in tok.encode(text, add_special_tokens=False):
            row.completion_token_ids.append(token)
            assert ref.accept_token(token)
    assert GuideCompiler(tok, len(tok) - 10, [tok.eos_token_id]).grammar_vocab_size == len(tok) - 10
