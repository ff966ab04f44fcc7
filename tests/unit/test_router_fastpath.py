"""The router's hot-path pieces: the fast block hash chain (same hashes as pdserve.common.hashing), the
per-request output buffer, merging everything buffered into one step (one client message),
OutputProcessor.step against the generic add(), the prompt's wire ids, and the scripted
worker's outbox (queued steps merged into one SequenceOutput per request)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import grpc.aio
import pytest

from pdserve.common.grpc_utils import InvalidArgument, Unavailable  # noqa: E402
from pdserve.common.grpc_utils.convert import sampling_params_to_proto  # noqa: E402
from pdserve.common.grpc_utils.errors import PEER_METADATA_KEY  # noqa: E402
from pdserve.common.outputs import FinishReason, SequenceOutput  # noqa: E402
from pdserve.common.sampling_params import SamplingParams  # noqa: E402
from pdserve.common.worker_types import PREFILL_CAPABLE, Reservation  # noqa: E402
from pdserve.loadtest.scripted_state import Outbox  # noqa: E402
from pdserve.router.attempt import Attempt, Cut, Retry  # noqa: E402
from pdserve.router.output import OutputProcessor  # noqa: E402
from pdserve.router.prefix_index import PrefixIndex  # noqa: E402
from pdserve.router.subscription import OutputBuffer  # noqa: E402
from pdserve.router.tokenization import build_prompt, resolve_spec  # noqa: E402
from pdserve.v1 import common_pb2, router_pb2, worker_pb2  # noqa: E402


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i >= 1000))


def test_prefix_index_truthiness() -> None:
    index = PrefixIndex()
    assert not index
    index.apply("w", stored=[1, 2])
    assert index
    index.remove_worker("w")
    assert not index


def test_output_buffer() -> None:
    async def scenario() -> None:
        buf = OutputBuffer()
        assert buf.empty()
        waiter = asyncio.ensure_future(buf.wait())
        await asyncio.sleep(0)
        assert not waiter.done()
        buf.put_nowait(1)
        buf.put_nowait(2)
        await asyncio.wait_for(waiter, 1)
        assert buf.take_all() == [1, 2] and buf.empty()
        buf.put_nowait(3)
        assert await buf.get() == 3
        with pytest.raises(asyncio.QueueEmpty):
            buf.get_nowait()

    asyncio.run(scenario())


def _attempt() -> Attempt:
    decode = SimpleNamespace(key="d", add_load=lambda *a, **k: None, mark_down=lambda *a: None,
                             leases=SimpleNamespace(hold=lambda *a: None, release=lambda *a: None))
    job = SimpleNamespace(prompt=SimpleNamespace(token_ids=[1, 2, 3]), expired=lambda: False,
                          sampling=SimpleNamespace(logprobs=False))
    att = Attempt(SimpleNamespace(settings=SimpleNamespace(lease_ms=30_000)), job, decode, None, "rid")
    att.queue = OutputBuffer()
    return att


def test_everything_buffered_is_one_step_and_an_error_comes_after_the_tokens() -> None:
    async def scenario() -> None:
        att = _attempt()
        for i in range(5):
            att.queue.put_nowait(SequenceOutput(request_id="rid", token_ids=[i, i + 10]))
        att.queue.put_nowait(Unavailable("stream broke"))
        step = await att.next()
        assert step.token_ids == [0, 10, 1, 11, 2, 12, 3, 13, 4, 14] and step.finish_reason is None
        with pytest.raises(Cut) as cut:         # the flow may continue it elsewhere (a migration)
            await att.next()
        assert isinstance(cut.value.cause, Unavailable) and cut.value.worker_key == att.decode.key

    asyncio.run(scenario())


def test_a_queued_transfer_failure_keeps_its_status_and_worker() -> None:
    """A KV transfer that failed after the first token is queued already decided (a Cut naming
    the prefill worker): next() raises it as it is, not wrapped as INTERNAL on the decode worker."""
    async def scenario() -> None:
        att = _attempt()
        att.first_seen = True
        queued = Cut(Unavailable("decode worker refused the KV"), "p")
        att.queue.put_nowait(queued)
        with pytest.raises(Cut) as cut:
            await att.next()
        assert cut.value is queued and isinstance(cut.value.cause, Unavailable)

    asyncio.run(scenario())


def _unavailable(peer: str = "") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((PEER_METADATA_KEY, peer)) if peer else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), trailing, details="refused")


@pytest.mark.parametrize("peer, down", [
    ("10.0.0.2:1", []),        # the prefill worker names this request's decode worker: nobody marked down
    ("", ["p"]),               # no peer named: the prefill worker failed, marked down
    ("10.0.0.9:1", ["p"]),     # a peer that is not this request's decode worker: as if none
])
def test_an_unavailable_prefill_naming_its_decode_worker_stays_up(peer: str, down: list[str]) -> None:
    att = _attempt()
    marked: list[str] = []
    att.decode.address = "10.0.0.2:1"
    att.decode.mark_down = lambda *a: marked.append("d")
    prefill = SimpleNamespace(key="p", address="10.0.0.3:1", mark_down=lambda *a: marked.append("p"))
    retry = att._fail(_unavailable(peer), prefill, "Prefill")
    assert isinstance(retry, Retry) and retry.worker_key == "p" and marked == down   # the retry avoids the pair
    assert "Prefill on p" in retry.cause.message


def test_step_ends_at_the_finish_reason() -> None:
    async def scenario() -> None:
        att = _attempt()
        att.queue.put_nowait(SequenceOutput(request_id="rid", token_ids=[7]))
        att.queue.put_nowait(SequenceOutput(request_id="rid", token_ids=[8], finish_reason=FinishReason.LENGTH))
        step = await att.next()
        assert step.token_ids == [7, 8] and step.finish_reason is FinishReason.LENGTH

    asyncio.run(scenario())


@pytest.mark.parametrize("stop", [(), ("END",), ("cd", "b")])
def test_output_step_equals_add(stop: tuple[str, ...]) -> None:
    chunks = ["Hel", "lo E", "N", "D abcd", "", "x"]
    a, b = OutputProcessor(CharTokenizer(), stop), OutputProcessor(CharTokenizer(), stop)
    for c in chunks:
        ids = [ord(ch) for ch in c]
        d = a.add(ids)
        assert b.step(ids) == (d.text, d.matched_stop)
    assert a.finish().text == b.finish().text and a.text == b.text
    assert b.num_tokens == sum(len(c) for c in chunks)


def test_prompt_wire_ids_and_vocab_check() -> None:
    spec = resolve_spec("tiny-llama")
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2, 3]))
    prompt = build_prompt(req, None, spec, spec.vocab_size)
    assert prompt.token_ids == [1, 2, 3] and list(prompt.wire_ids) == [1, 2, 3]
    assert worker_pb2.SubmitRequest(token_ids=prompt.wire_ids).token_ids == [1, 2, 3]
    bad = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 600, 2, 700]))
    with pytest.raises(InvalidArgument) as e:
        build_prompt(bad, None, spec, spec.vocab_size)
    assert e.value.field == "token_ids.ids[1]"


def test_scripted_outbox_merges_per_request() -> None:
    async def scenario() -> None:
        box = Outbox()
        box.add("a", [1], None, num_prompt=3, num_cached=0)
        box.add("b", [5], [-0.5])
        box.add("a", [2, 3], None)
        box.add("b", [6], [-0.6], finish=common_pb2.FINISH_REASON_LENGTH)
        assert box.ready.is_set()
        msg = box.take(7)
        assert not box.ready.is_set() and msg.step == 7
        outs = {o.request_id: o for o in msg.outputs}
        assert list(outs["a"].token_ids) == [1, 2, 3] and outs["a"].num_prompt_tokens == 3
        assert list(outs["b"].token_ids) == [5, 6] and outs["b"].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert [round(x, 3) for x in outs["b"].logprobs] == [-0.5, -0.6]

    asyncio.run(scenario())


def test_params_cache_shares_validated_params_and_never_caches_errors() -> None:
    from pdserve.router.validation import ParamsCache
    cache = ParamsCache(vocab_size=512, has_tokenizer=False, max_entries=2)
    k1, p1 = cache.validate(common_pb2.SamplingParams(max_tokens=5, temperature=0.5))
    k2, p2 = cache.validate(common_pb2.SamplingParams(temperature=0.5, max_tokens=5))
    assert k1 == k2 and p1 is p2 and p1.max_tokens == 5
    s1 = cache.resolve(k1, p1, 5)
    assert cache.resolve(k1, p1, 5) is s1 and s1.max_tokens == 5 and sampling_params_to_proto(s1).max_tokens == 5
    assert cache.resolve(k1, p1, 7).max_tokens == 7
    for _ in range(2):              # invalid: raised every time
        with pytest.raises(InvalidArgument):
            cache.validate(common_pb2.SamplingParams(top_p=-1))
    for t in (0.1, 0.2, 0.3):       # bounded
        cache.validate(common_pb2.SamplingParams(temperature=t))
    assert len(cache._params) <= 2


class FakeCall:
    """A Prefill rpc that never answers (until cancelled)."""

    def __init__(self) -> None:
        self.cancelled = False
        self.read_waiter: asyncio.Future | None = None

    def cancel(self) -> bool:
        self.cancelled = True
        if self.read_waiter is not None and not self.read_waiter.done():
            self.read_waiter.cancel()
        return True

    def done(self) -> bool:
        return self.cancelled

    async def read(self):
        self.read_waiter = asyncio.get_running_loop().create_future()
        return await self.read_waiter


def test_decode_stream_break_before_the_first_token_cancels_the_prefill_call() -> None:
    """Disaggregated, waiting for the Prefill stream's first token: an error on the decode
    worker's output stream cancels the Prefill call and fails over (a Retry naming the decode
    worker), without a watcher task."""
    from pdserve.router.attempt import Retry
    from pdserve.router.worker_client import PrefillStream

    async def scenario() -> None:
        att = _attempt()
        att.prefill = SimpleNamespace(key="p", add_load=lambda *a, **k: None)
        call = FakeCall()
        att.prefill_call = PrefillStream(call, "rid", logprobs=False)
        att.queue.on_put = att._on_decode_output
        reader = asyncio.ensure_future(att.next())
        await asyncio.sleep(0)
        att.queue.put_nowait(SequenceOutput(request_id="rid"))   # not an error: ignored
        await asyncio.sleep(0)
        assert not call.cancelled and not reader.done()
        att.queue.put_nowait(Unavailable("decode worker d: output stream broke"))
        with pytest.raises(Retry) as e:
            await reader
        assert call.cancelled and e.value.worker_key == "d" and att.queue.on_put is None

    asyncio.run(scenario())


def test_prefill_request_is_built_before_the_reservation_answers() -> None:
    from pdserve.router.settings import RouterSettings
    from pdserve.router.worker_client import WorkerClient

    async def scenario() -> None:
        att = _attempt()
        att.rid = "w-1"
        att.job.prompt = SimpleNamespace(token_ids=[1, 2, 3], wire_ids=[1, 2, 3])
        att.job.sampling = SamplingParams(max_tokens=4)
        att.job.deadline_unix_ms = 0
        att.job.remaining = lambda: None
        sent = []
        att.prefill = prefill = WorkerClient("p:1", PREFILL_CAPABLE, RouterSettings("r"), PrefixIndex(),
                                             lambda c, i: None)
        prefill.stub = SimpleNamespace(Prefill=lambda req, **kw: sent.append(req) or FakeCall())
        att.decode.worker_id, att.decode.address = "dw", "d:1"
        att.after_send()
        early = att._prefill_req
        assert list(early.token_ids) == [1, 2, 3] and early.params.max_tokens == 4
        att._start_prefill(Reservation(block_ids=[5], kv_store_address="kv:1", num_cached_tokens=0))
        assert sent == [early] and early.kv_target.decode_worker_id == "dw" and list(early.kv_target.block_ids) == [5]
        assert early.kv_target.decode_address == "d:1" and early.kv_target.kv_store_address == "kv:1"
        assert att.prefill_call is not None and att.prefill_call.call is not None
        await prefill.channel.close()

    asyncio.run(scenario())


def test_early_headers_are_sent_once_and_settled() -> None:
    from pdserve.router.servicer import EarlyHeaders

    async def scenario() -> None:
        sent = []

        async def send_initial_metadata(md):
            await asyncio.sleep(0)
            sent.append(md)

        headers = EarlyHeaders(SimpleNamespace(send_initial_metadata=send_initial_metadata))
        await headers.settle()          # nothing sent: nothing to wait for
        headers.send()
        headers.send()                  # a retry: still one
        await headers.settle()
        assert sent == [()] and headers.task.done()

    asyncio.run(scenario())
