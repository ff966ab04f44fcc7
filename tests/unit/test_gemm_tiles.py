"""The Gluon GEMMs' tile rules (pdserve/common/ops/gemm_tiles.py): hand-computed cases."""
from __future__ import annotations

import pytest

from pdserve.common.ops.gemm_tiles import SMEM_BYTES, WIDE_ROWS, Tiles, padded_rows, wide_fits, wide_tiles


def test_tile_classes_by_rows():
    assert wide_tiles("qkv", 33) == wide_tiles("qkv", 128) == Tiles(64, 32, 128, 4)
    assert wide_tiles("qkv", 129) == wide_tiles("qkv", WIDE_ROWS) == Tiles(64, 64, 128, 3)
    assert wide_tiles("gate_up", 64) == wide_tiles("gate_up", 128) == Tiles(64, 32, 128, 3)
    assert wide_tiles("gate_up", WIDE_ROWS) == Tiles(64, 32, 64, 4)
    assert wide_tiles("o_proj", 64) == wide_tiles("down", 64) == Tiles(64, 32, 128, 3, splits=4)
    assert wide_tiles("o_proj", 128) == Tiles(128, 32, 128, 3, splits=4)
    assert wide_tiles("down", 128) == Tiles(64, 32, 128, 3, splits=4)
    assert wide_tiles("down", 129) == wide_tiles("o_proj", 256) == Tiles(128, 32, 128, 3, splits=2, overlap=False)


def test_smem_formula():
    # 3 stages x (128 + 32) rows x 128 columns x 2 B + a 128 x 32 fp32 output tile
    assert Tiles(128, 32, 128, 3, splits=2).smem_bytes(1, 4) == 3 * 160 * 128 * 2 + 128 * 32 * 4 == 139264
    # gate_up: two weight tiles a step
    assert Tiles(128, 32, 64, 4).smem_bytes(2, 2) == 4 * 192 * 64 * 2 + 128 * 32 * 2 == 106496
    assert Tiles(128, 128, 256, 6).smem_bytes(2, 4) > SMEM_BYTES


def test_fits_needs_whole_tiles_and_splits():
    assert Tiles(64, 32, 128, 3, splits=4).fits(1024, 2048)        # 2048 = 4 splits x 4 steps of 128
    assert Tiles(64, 32, 128, 3, splits=4).fits(1024, 1536)        # 1536 / 4 = 384: 3 steps
    assert not Tiles(64, 32, 128, 3, splits=4).fits(1024, 1280)    # 1280 / 4 = 320: not whole steps
    assert not Tiles(64, 64, 64, 4).fits(1056, 1024)               # 1056 columns: 16.5 tiles of 64


def test_geometries():
    # Qwen3-0.6B: q 2048, qkv 4096, hidden 1024, intermediate 3072
    assert wide_fits(2048, 4096, 1024, 3072)
    # Qwen3-8B: q 4096, qkv 6144, hidden 4096, intermediate 12288: tiles exactly, but gate_up is
    # 2 x 12288 x 4096 x 2 B = 201 MB (and qkv 50 MB), past MAX_WEIGHT_BYTES
    assert not wide_fits(4096, 6144, 4096, 12288)
    # Qwen2.5-7B: weights of 33-287 MB
    assert not wide_fits(3584, 4608, 3584, 18944)
    # gate_up 2 x 2048 x 2048 x 2 B = 16 MiB: just taken; one more 64 columns of intermediate: not
    assert wide_fits(2048, 4096, 2048, 2048) and not wide_fits(2048, 4096, 2048, 2112)
    # q 1280: o_proj's K of 1280 in 4 splits is 320 columns each, not whole 128-column steps
    assert not wide_fits(1280, 2560, 1280, 3072)


@pytest.mark.parametrize("bad", [dict(bm=32), dict(bn=48), dict(bk=96), dict(stages=1), dict(splits=3)])
def test_invalid_tiles_are_refused(bad):
    with pytest.raises(ValueError):
        Tiles(**{"bm": 64, "bn": 32, "bk": 128, "stages": 3, **bad})


def test_unknown_op_or_rows_refused():
    with pytest.raises(ValueError, match="projection"):
        wide_tiles("lm_head", 64)
    with pytest.raises(ValueError, match="rows"):
        wide_tiles("qkv", WIDE_ROWS + 1)


def test_padded_rows_are_whole_tiles_of_every_projection():
    assert [padded_rows(m) for m in (33, 48, 64, 65, 128, 129, 160, 256)] == [64, 64, 64, 128, 128, 256, 256, 256]
    for m in range(33, WIDE_ROWS + 1):
        assert all(padded_rows(m) % wide_tiles(op, m).bm == 0 for op in ("qkv", "o_proj", "gate_up", "down"))
    with pytest.raises(ValueError, match="rows"):
        padded_rows(0)
