"""Tile shapes of the Gluon GEMMs (pdserve/common/ops/gluon_gemm.py) that carry the decode chain's
projections at ``MAX_ROWS + 1`` to ``WIDE_ROWS`` rows (pdserve/common/models/dataflow_decode.py).

Pure rules over plain values; the kernels' constraints are checked here so that a geometry the
tiles do not fit falls back to the usual forward instead of failing in a kernel.

A program computes one ``bm x bn`` output tile over ``K / splits`` columns in ``bk`` steps,
through a ring of ``stages`` shared-memory buffers; ``overlap`` keeps one warp-group MMA in flight
while the slot of the one before refills; ``m_fast`` orders the grid M tiles first, so that the
programs reading one weight tile start together. Shared memory per program:

    stages * (bm + weight_tiles * bn) * bk * 2 B   (the rings; weight_tiles = 2 for gate_up)
  + bm * bn * out_bytes                             (the output tile)

which must stay within ``SMEM_BYTES``. The tiles by projection and rows (``wide_tiles``):

- ``qkv``: (bm 64, bn 32, bk 128, 4 stages) up to 128 rows, (64, 64, 128, 3) beyond;
- ``gate_up`` (gate and up tiles in one program, SiLU-mul in its epilogue): (64, 32, 128, 3) up
  to 128 rows, (64, 32, 64, 4) beyond;
- ``o_proj``, ``down`` (N = hidden: too few N tiles to fill the GPU, so split over K into fp32
  partials): 4 splits of (64, 32, 128, 3) up to 64 rows; 4 splits of (128, 32, 128, 3) for
  o_proj and (64, 32, 128, 3) for down up to 128; beyond, 2 splits of (128, 32, 128, 3) without
  overlap (the partials' bytes grow with the rows).

Each program reads the whole activation for its N tile: (N / bn) x M x K x 2 B from L2 against
the weight's N x K x 2 B. So a geometry is taken only when every projection weight is at most
``MAX_WEIGHT_BYTES`` (``wide_fits``); larger weights keep the usual forward.

The activations a chain of them reads have ``padded_rows`` rows, whole M tiles, so that no TMA
load runs past the end of its tensor.

Why these tiles and limits (the timings that chose them, and what lost):
bench/notes/decode_chain.md, "Tile choices of the wide range".
"""
from __future__ import annotations

import dataclasses

SMEM_BYTES = 227 * 1024        # an H100 program's shared memory
MAX_WEIGHT_BYTES = 16 << 20    # the largest projection weight the wide range takes (below)
OPS = ("qkv", "o_proj", "gate_up", "down")
WIDE_ROWS = 256                # the largest batch the Gluon tiles were chosen for


@dataclasses.dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int
    stages: int
    splits: int = 1
    overlap: bool = True
    m_fast: bool = True

    def __post_init__(self) -> None:
        if self.bm not in (64, 128):
            raise ValueError(f"bm must be 64 or 128 (one or two warp-group MMAs of 64 rows), not {self.bm}")
        if self.bn not in (32, 64, 128) or self.bk not in (64, 128, 256):
            raise ValueError(f"bn must be 32, 64 or 128 and bk 64, 128 or 256, not {self.bn} / {self.bk}")
        if not 2 <= self.stages <= 6:
            raise ValueError(f"stages must be 2..6, not {self.stages}")
        if self.splits not in (1, 2, 4, 8):
            raise ValueError(f"splits must be 1, 2, 4 or 8, not {self.splits}")

    def smem_bytes(self, weight_tiles: int = 1, out_bytes: int = 2) -> int:
        """Shared memory a program of these tiles allocates (the formula above)."""
        return self.stages * (self.bm + weight_tiles * self.bn) * self.bk * 2 + self.bm * self.bn * out_bytes

    def fits(self, n: int, k: int) -> bool:
        """Whether a weight of ``[n, k]`` (for ``gate_up``: n = the intermediate size) tiles exactly."""
        return n % self.bn == 0 and k % (self.splits * self.bk) == 0


def wide_tiles(op: str, rows: int) -> Tiles:
    """The tiles of projection ``op`` (one of ``OPS``) at ``rows`` decode rows (the rules above)."""
    if op not in OPS:
        raise ValueError(f"unknown projection {op!r}; expected one of {OPS}")
    if not 1 <= rows <= WIDE_ROWS:
        raise ValueError(f"{rows} rows: the wide tiles were chosen for 1..{WIDE_ROWS}")
    if op == "qkv":
        return Tiles(64, 32, 128, 4) if rows <= 128 else Tiles(64, 64, 128, 3)
    if op == "gate_up":
        return Tiles(64, 32, 128, 3) if rows <= 128 else Tiles(64, 32, 64, 4)
    if rows <= 64 or (rows <= 128 and op == "down"):
        return Tiles(64, 32, 128, 3, splits=4)
    return Tiles(128, 32, 128, 3, splits=4) if rows <= 128 else Tiles(128, 32, 128, 3, splits=2, overlap=False)


def padded_rows(rows: int) -> int:
    """Rows of the activations at ``rows`` decode rows: whole tiles of every projection's ``bm``
    (64 up to 64 rows, else a multiple of 128)."""
    if not 1 <= rows <= WIDE_ROWS:
        raise ValueError(f"{rows} rows: the wide tiles were chosen for 1..{WIDE_ROWS}")
    tile = 64 if rows <= 64 else 128
    return -(-rows // tile) * tile


def wide_fits(q_size: int, qkv_size: int, hidden: int, intermediate: int, dtype_bytes: int = 2) -> bool:
    """Whether every projection of a decoder of these sizes is small enough (``MAX_WEIGHT_BYTES``),
    tiles exactly at every row count and fits in shared memory: qkv [qkv_size, hidden], o_proj
    [hidden, q_size], gate_up [2 * intermediate, hidden] (tiled per half), down [hidden, intermediate]."""
    shapes = {"qkv": (qkv_size, hidden), "o_proj": (hidden, q_size), "gate_up": (intermediate, hidden),
              "down": (hidden, intermediate)}
    if 2 * intermediate * hidden * dtype_bytes > MAX_WEIGHT_BYTES or any(
            n * k * dtype_bytes > MAX_WEIGHT_BYTES for n, k in shapes.values()):
        return False
    for rows in (64, 128, WIDE_ROWS):                      # one of each tile class
        for op, (n, k) in shapes.items():
            tiles = wide_tiles(op, rows)
            weight_tiles, out_bytes = (2, 2) if op == "gate_up" else (1, 4 if tiles.splits > 1 else 2)
            if not tiles.fits(n, k) or tiles.smem_bytes(weight_tiles, out_bytes) > SMEM_BYTES:
                return False
    return True
