"""KV shipped between workers of different tensor-parallel layouts, started as users start them
(``pdserve up --prefill 1 --decode 1`` with ``--prefill-/--decode-tensor-parallel-size``), on
the CPU over Gloo with real rank processes: each prefill rank sends its KV heads straight to the
decode rank(s) holding them. P TP1 -> D TP2, P TP2 -> D TP1 and P TP2 -> D TP2 answer exactly what
the one-rank engine generates (the tiny fp32 models), every request's KV crossed, both pools are whole;
and transfers land on the TP2 decode worker while its ranks run decode steps (their
all-reduces) for a long stream, with no deadlock and that stream unchanged."""
from __future__ import annotations

import asyncio
import random
import threading

import grpc
import pytest

from bench import deployment
from bench.disagg_gpu import compare, run_all
from pdserve.common.engine import LLM, SamplingParams
from pdserve.v1 import common_pb2, router_pb2

MAX_TOKENS = 16
LONG = 600          # never reached: the stream is cancelled once the transfers are done
CHECKED = 48        # its first tokens, compared with the one-rank engine's


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(37)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    return [shared + [rng.randrange(3, 500) for _ in range(rng.randint(4, 40))] for _ in range(8)]


_ONE_RANK: dict[str, tuple] = {}


def one_rank(model: str, prompts: list[list[int]]) -> tuple:
    """The one-rank engine's greedy answers: the prompts, and the long stream's first tokens
    (once a model)."""
    if model in _ONE_RANK:
        return _ONE_RANK[model]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model, device="cpu", num_kv_blocks=256) as llm:
        short = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        long = llm.generate([prompts[0][::-1]], SamplingParams(temperature=0, max_tokens=CHECKED, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    _ONE_RANK[model] = short, long
    return short, long


# tiny-qwen3: 2 KV heads, one a rank at TP2 (each rank's heads go to, or come from, another
# rank; at P2 -> D2 rank 1 sends to rank 1, past both rank 0s); tiny-llama: 1 KV head,
# replicated on both decode ranks (each gets it whole)
@pytest.fixture(scope="module", params=[("tiny-qwen3", 1, 2), ("tiny-qwen3", 2, 1), ("tiny-qwen3", 2, 2),
                                        ("tiny-llama", 1, 2)],
                ids=["P1-D2", "P2-D1", "P2-D2", "P1-D2-replicated"])
def pair(request, tmp_path_factory):
    model, p, d = request.param
    dep = deployment.start_up(tmp_path_factory.mktemp(f"tp-p{p}d{d}"), [
        "--model", model, "--prefill", "1", "--decode", "1", "--num-kv-blocks", "64",
        "--prefill-tensor-parallel-size", str(p), "--decode-tensor-parallel-size", str(d),
        "--extra-router-args=--admission-slo-multiple 0 --pd-policy always"])
    yield dep, model, p, d
    dep.stop()


class LongStream(threading.Thread):
    """A greedy stream of LONG tokens through the router, collected in ``ids``; ``started`` once
    it has decoded a few; ``stop`` cancels it."""

    def __init__(self, dep, tokens: list[int]) -> None:
        super().__init__(daemon=True)
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens), params=common_pb2.SamplingParams(
            temperature=0, max_tokens=LONG, ignore_eos=True))
        self.call = dep.router_stub().Generate(req, timeout=240)
        self.ids: list[int] = []
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            for msg in self.call:
                self.ids.extend(msg.token_ids)
                if len(self.ids) >= 4:
                    self.started.set()
        except grpc.RpcError as e:
            self.error = e
        self.started.set()

    def stop(self) -> None:
        self.call.cancel()
        self.join(60)


def test_disaggregated_equals_one_rank_while_the_decode_ranks_step(pair, prompts):
    dep, model, p, d = pair
    short, long = one_rank(model, prompts)
    # a long stream decodes first (the decode ranks' all-reduces run step after step) ...
    streamer = LongStream(dep, prompts[0][::-1])
    streamer.start()
    assert streamer.started.wait(120) and streamer.error is None
    # ... while every other request's KV crosses rank to rank into the same decode worker (the
    # first alone: the others then find the shared prefix there and ship only their new blocks)
    got = [*asyncio.run(run_all(dep.router, prompts[:1], MAX_TOKENS, timeout=240)),
           *asyncio.run(run_all(dep.router, prompts[1:], MAX_TOKENS, timeout=240))]
    so_far = list(streamer.ids)
    streamer.stop()
    assert streamer.error is None or streamer.error.code() == grpc.StatusCode.CANCELLED
    assert 4 <= len(so_far) < LONG                 # still decoding when the last transfer landed
    assert so_far[:CHECKED] == long[:len(so_far)]   # and unchanged by them
    eq = compare([(e, 0.0) for e in short], got)
    assert eq["identical"] == eq["requests"] == len(prompts), eq
    decode, prefill = dep.stats(dep.decode[0]), dep.stats(dep.prefill[0])
    assert (decode.tensor_parallel_size, prefill.tensor_parallel_size) == (d, p)
    assert prefill.num_kv_transfers == decode.num_kv_transfers == len(prompts) + 1
    assert decode.prefix_cache_hit_tokens >= 32 * (len(prompts) - 1)     # only the new blocks crossed
    assert dep.wait_whole(dep.decode[0]).num_free_blocks == 64
    assert dep.wait_whole(dep.prefill[0]).num_free_blocks == 64
