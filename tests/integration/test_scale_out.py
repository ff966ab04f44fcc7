"""Scale-out on the CPU: router + 2 prefill + 3 decode workers (embedded model, Gloo), real
processes. A shared-prefix run spreads over every decode worker while each system prompt's
blocks stay on one or two of them, outputs equal the offline engine's and every pool ends
whole; then one decode worker is killed and one prefill worker drained (SIGTERM) under load,
and no request fails before its first token (those are retried on other workers). The router
continues a stream cut after its first token on another worker (``--migration-limit``): the
requests the kill cuts complete, and one long stream whose decode worker is killed under it
ends with the offline engine's tokens."""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench import deployment as services
from pdserve.common.engine import SamplingParams
from pdserve.common.hashing import block_hash_chain
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

MAX_TOKENS = 8
BS = 16
TOPICS = ["Railway company Nordbahn", "City library of Lyon", "Mountain hotel Alpenblick"]
QUESTIONS = ["When do you open?", "Is there parking?", "Can I bring a dog?"]


def system(topic: str) -> str:
    return (f"{topic}: you answer for us briefly and precisely, never invent facts, "
            "quote opening hours and prices exactly, and say so when you are unsure. ") * 4


@pytest.fixture(scope="module")
def prompts(offline):
    return {t: [offline.apply_chat_template([{"role": "system", "content": system(t)},
                                             {"role": "user", "content": q}]) for q in QUESTIONS] for t in TOPICS}


@pytest.fixture(scope="module")
def expected(offline, prompts):
    flat = [p for t in TOPICS for p in prompts[t]]
    outs = offline.generate(flat, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {tuple(p): o.token_ids for p, o in zip(flat, outs)}


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    # admission control off: the failover test's burst (~1,900 prompt tokens in 1.8 s, one prefill
    # worker left) is over what the CPU prefills within the 1 s TTFT objective, so it would refuse
    d = services.start(tmp_path_factory.mktemp("scale"), num_prefill=2, num_decode=3,
                       router_args=["--migration-limit", "2", "--admission-slo-multiple", "0"])
    yield d
    d.stop()


def stream(d, tokens: list[int], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False,
           on_tokens=None) -> tuple[list[int], int | None]:
    """(token ids, None) on success; (tokens streamed, status code) on failure. ``on_tokens``
    is called with the ids so far after each message."""
    ids: list[int] = []
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens), params=common_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    try:
        for msg in d.router_stub().Generate(req, timeout=180):
            ids.extend(msg.token_ids)
            if on_tokens is not None:
                on_tokens(ids)
    except grpc.RpcError as e:
        return ids, e.code()
    return ids, None


def cached_hashes(address: str) -> set[int]:
    with grpc.insecure_channel(address) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).StreamKvEvents(worker_pb2.KvEventsRequest(), timeout=10)
        first = next(iter(call))
        call.cancel()
    assert first.snapshot and first.seq >= 0
    return set(first.stored)


def test_shared_prefix_spreads_and_concentrates(dep, prompts, expected):
    # the topics' questions in turn (A1 B1 C1 A2 ...), each decided on idle workers: the first
    # of each topic spreads (ties rotate), the rest follow its cached prefix
    runs = [(p, stream(dep, p)) for q in range(len(QUESTIONS)) for p in (prompts[t][q] for t in TOPICS)]
    held = [cached_hashes(a) for a in dep.decode]
    for t in TOPICS:
        head = block_hash_chain(prompts[t][0], BS)[:8]       # blocks of the system prompt
        holders = sum(1 for h in held if head[-1] in h)
        assert holders == 1, f"{t}: system prompt cached on {holders} decode workers"
    assert sum(dep.stats(a).prefix_cache_hit_tokens for a in dep.decode) > 0
    # then all at once: the load spreads the burst over every decode worker
    with ThreadPoolExecutor(9) as pool:
        burst = list(pool.map(lambda p: (p, stream(dep, p)), [p for t in TOPICS for p in prompts[t]]))
    for p, (ids, err) in runs + burst:
        assert err is None and ids == expected[tuple(p)]
    transfers = [dep.stats(a).num_kv_transfers for a in dep.decode]
    assert all(n > 0 for n in transfers), f"every decode worker gets traffic: KV transfers {transfers}"
    for a in dep.decode + dep.prefill:
        dep.wait_whole(a)


def test_kill_decode_and_drain_prefill_under_load(dep, prompts, expected):
    flat = [p for t in TOPICS for p in prompts[t]] + [p for t in TOPICS for p in prompts[t][:1]]
    results: list = [None] * len(flat)

    def run(i: int) -> None:
        results[i] = stream(dep, flat[i], MAX_TOKENS)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(flat))]
    for i, th in enumerate(threads):
        th.start()
        if i == len(flat) // 2:
            dep.services["prefill1"].proc.send_signal(signal.SIGTERM)    # drain
        if i == len(flat) // 2 + 4:         # once the drained worker's refusals were retried
            dep.kill("decode2")                                            # crash
        time.sleep(0.15)
    for th in threads:
        th.join(180)
    failed = [(i, len(ids), err) for i, (ids, err) in enumerate(results) if err is not None]
    assert not failed, f"requests failed (index, tokens streamed, code): {failed}"
    for p, (ids, _) in zip(flat, results):
        assert ids == expected[tuple(p)]
    assert dep.services["prefill1"].proc.wait(60) is not None              # drained and exited
    for a in (dep.decode[0], dep.decode[1], dep.prefill[0]):
        dep.wait_whole(a, tries=300)


LONG = 40


def test_stream_cut_after_its_first_token_goes_on_elsewhere(dep, offline, prompts):
    """The decode worker of a running stream killed after its first tokens: the router goes on
    from prompt + the tokens already sent on the other decode worker; the client sees one
    stream with the offline engine's greedy tokens. Runs last: it leaves one decode worker."""
    p = prompts[TOPICS[1]][2]
    want = offline.generate([p], SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    live = [f"decode{i}" for i in range(len(dep.decode)) if dep.services[f"decode{i}"].proc.poll() is None]
    assert len(live) >= 2
    killed: list[str] = []

    def kill_its_decode_worker(ids: list[int]) -> None:
        if killed or len(ids) < 4:
            return
        for name in live:
            if dep.stats(dep.services[name].address).num_running:
                dep.kill(name)
                killed.append(name)
                return

    ids, err = stream(dep, p, LONG, ignore_eos=True, on_tokens=kill_its_decode_worker)
    assert killed, "the stream's decode worker was not found running it"
    assert err is None and ids == want
    survivor = next(n for n in live if n not in killed)
    dep.wait_whole(dep.services[survivor].address, tries=300)
