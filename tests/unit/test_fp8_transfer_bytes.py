"""Bytes of an FP8 KV transfer: for the same geometry an e4m3 block is half a bf16 block, in the
engine's ``block_bytes`` (what the workers count), in ``bytes_per_block`` of the pool (what the
channels plan with) and in the payload that actually crosses a pair channel (Gloo, one process).
Nothing else crosses per block: the per-tensor scales stay with the model on both sides."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.kv_transfer import KvReceiver, KvSender, KvStoreServer, bytes_per_block
from pdserve.common.kv_transfer.blocks import wire_view
from pdserve.common.kv_transfer.channel import PairChannel

pytestmark = pytest.mark.timeout(120)

# [num_blocks, layers, 2, block_size, kv_heads, head_dim]: Qwen3-0.6B's layers / heads / head_dim
QWEN3_06B = (6, 28, 2, 16, 8, 128)
ELEMENTS_PER_BLOCK = 28 * 2 * 16 * 8 * 128
TOKEN_TRAILER = 8      # the first token's bytes at the end of the last message


def _pool(dtype: torch.dtype, seed: int, shape=QWEN3_06B) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def test_bytes_per_block_fp8_is_half_bf16_for_the_same_geometry():
    fp8, bf16 = _pool(torch.float8_e4m3fn, 0), _pool(torch.bfloat16, 0)
    assert bytes_per_block(fp8) == ELEMENTS_PER_BLOCK == 917_504
    assert bytes_per_block(bf16) == 2 * ELEMENTS_PER_BLOCK
    assert bytes_per_block(wire_view(fp8)) == bytes_per_block(fp8)     # the byte view adds nothing
    assert wire_view(fp8).shape == fp8.shape and wire_view(fp8).dtype == torch.uint8


def _send_and_measure(src: torch.Tensor, src_ids: list[int], dst_ids: list[int], monkeypatch) -> tuple[int, int]:
    """Ship ``src_ids`` of ``src`` into a fresh pool's ``dst_ids`` over a real pair channel (first
    token included); returns (bytes the sender reports, payload bytes handed to the channel).
    The landed blocks must equal the sent ones bit for bit."""
    from pdserve.common.kv_transfer import FirstTokenRef
    sent: list[int] = []
    real_isend = PairChannel.isend

    def counting_isend(self, tensor, tag=0):
        sent.append(tensor.numel() * tensor.element_size())
        return real_isend(self, tensor, tag)
    monkeypatch.setattr(PairChannel, "isend", counting_isend)
    dst = torch.zeros_like(src)
    with KvStoreServer("127.0.0.1", 0) as server:
        recv = KvReceiver(dst, "d", server, timeout=10, max_message_bytes=2 * bytes_per_block(src))
        sender = KvSender("p", timeout=10, max_message_bytes=2 * bytes_per_block(src), first_epoch=1)
        fut = recv.post("p", 1, dst_ids, with_first_token=True)
        token = FirstTokenRef(torch.tensor([11]), torch.tensor([-0.5]), 0)
        nbytes, _ = sender.send_blocks("d", server.address, 1, src, src_ids, first_token=token)
        got = fut.result(timeout=10)
        sender.close()
        recv.close()
    assert got.num_bytes == nbytes and got.first_token == (11, -0.5)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(wire_view(dst[d]), wire_view(src[s])), (s, d)
    return nbytes, sum(sent)


def test_an_fp8_transfer_moves_half_the_bytes_of_a_bf16_one(monkeypatch):
    """Same geometry, same blocks (non-contiguous ids, cut into chunks): the reported bytes and
    the payload on the channel of the FP8 pool are half those of the bf16 pool, first token aside."""
    src_ids, dst_ids = [4, 0, 2], [1, 5, 3]
    fp8_bytes, fp8_wire = _send_and_measure(_pool(torch.float8_e4m3fn, 1), src_ids, dst_ids, monkeypatch)
    bf16_bytes, bf16_wire = _send_and_measure(_pool(torch.bfloat16, 1), src_ids, dst_ids, monkeypatch)
    assert fp8_bytes == len(src_ids) * ELEMENTS_PER_BLOCK
    assert bf16_bytes == 2 * fp8_bytes
    assert fp8_wire == fp8_bytes + TOKEN_TRAILER and bf16_wire == bf16_bytes + TOKEN_TRAILER


def test_engine_block_bytes_is_the_pool_block_in_either_cache_dtype():
    """The bytes a worker counts per shipped block (``ModelRunner.block_bytes``) are the bytes of
    a block of the pool it allocated; the FP8 pool's are half the bf16 pool's (tiny preset)."""
    from pdserve.common.engine import LLM
    per_block = {}
    for kv in ("auto", "fp8"):
        llm = LLM("tiny-qwen3", dtype="bfloat16", device="cpu", kv_cache_memory_gb=0.002, kv_cache_dtype=kv,
                  max_model_len=256, max_num_batched_tokens=256)
        runner = llm.engine.model_runner
        assert runner.block_bytes == bytes_per_block(runner.kv_cache) == bytes_per_block(wire_view(runner.kv_cache))
        per_block[kv] = runner.block_bytes
    assert per_block["fp8"] * 2 == per_block["auto"]
