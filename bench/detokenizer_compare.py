"""Incremental detokenization on the router's hot path: pdserve.common.detokenizer vs
``tokenizers.decoders.DecodeStream``, per token, on the embedded model's tokenizer.

    python -m bench.detokenizer_compare [--repeats 5]

Prints microseconds per token for both (one token per step and four, as merged steps
arrive) and checks that they emit the same text (ASCII,
accents, CJK and emoji, whose UTF-8 bytes span several byte-fallback tokens; special tokens
skipped as the router does).
"""
from __future__ import annotations

import argparse
import time

from pdserve.common.default_model import ensure_default_model
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.router.tokenization import RouterTokenizer

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, museums and cafés. " * 8,
    "Zürich, São Paulo, Kraków and Reykjavík are cities; naïve façade déjà vu. " * 6,
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. " * 6,
    "Emoji: 🚀🔥👍🏽 and 🧑‍🚀 floating in text, then code: `def f(x): return x ** 2` " * 6,
]


def run(tok: RouterTokenizer, ids: list[int], decode_stream: bool, step: int) -> tuple[str, float]:
    """(text, seconds) of one completion fed ``step`` tokens at a time, as the router does."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    if not decode_stream:
        detok._stream = None            # the Python offsets algorithm
    start = time.perf_counter()
    text = "".join(detok.add(ids[i:i + step]) for i in range(0, len(ids), step)) + detok.flush()
    return text, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs of each text; the best one counts")
    args = p.parse_args()
    tok = RouterTokenizer(ensure_default_model())
    eos = tok.hf.eos_token_id
    for step in (1, 4):
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False) + [eos]      # a special token at the end
            a = min((run(tok, ids, False, step) for _ in range(args.repeats)), key=lambda r: r[1])
            b = min((run(tok, ids, True, step) for _ in range(args.repeats)), key=lambda r: r[1])
            same = "same text" if a[0] == b[0] else f"DIFFERENT: {a[0][:40]!r} vs {b[0][:40]!r}"
            print(f"{step} token(s)/step, {len(ids):4d} tokens: offsets {a[1] / len(ids) * 1e6:6.2f} us/token, "
                  f"DecodeStream {b[1] / len(ids) * 1e6:6.2f} us/token, {same} ({text[:20]!r})")

if __name__ == "__main__":
    main()
