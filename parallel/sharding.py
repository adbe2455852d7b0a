"""Where each parameter lives on the grid, and how full tensors move in and out of shards.

Every parameter the engine creates carries a `ShardSpec`: the axes its values differ over (the rest
replicate it) and the axes its gradient is summed over by `sync_gradients`. Parameters without a
spec are plain replicas whose rows of data differ on every axis (easy mode), so they sum over all.

Initialization is shard-local and grid-independent: the full matrix is defined tile by tile (64
rows per tile) by a generator seeded from (seed, layer name, tile), and each rank draws only the
tiles that cover its own block. The same seed therefore gives the same full weight on every grid,
and no rank ever holds more than its shard plus a few tiles.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from . import comm
from .grid import AXES, Grid

TILE_ROWS = 64
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ShardSpec:
    shard_axes: tuple[str, ...] = ()
    """Axes over which this parameter's values differ; it is replicated over the others."""
    reduce_axes: tuple[str, ...] = AXES
    """Axes over which its gradient is summed after backward (where the rows of data differ)."""


REPLICATED = ShardSpec()


def tag(param: torch.nn.Parameter, shard_axes=(), reduce_axes=AXES) -> torch.nn.Parameter:
    param._mt_spec = ShardSpec(tuple(shard_axes), tuple(reduce_axes))
    return param


def check_sizes(what: str, **sizes: int) -> None:
    """A one-line error for a size below 1, before a layer builds an empty weight or divides by it."""
    for name, n in sizes.items():
        if n < 1:
            raise ValueError(f"{what}: {name}={n} is invalid: use a size of at least 1")


def spec_of(param: torch.Tensor) -> ShardSpec:
    return getattr(param, "_mt_spec", REPLICATED)


def is_tagged(param: torch.Tensor) -> bool:
    """Whether the engine gave this parameter a ShardSpec (an untagged one is a plain replica)."""
    return hasattr(param, "_mt_spec")


def unique_parameters(module_or_params) -> list[torch.nn.Parameter]:
    """Parameters of a module (or an iterable of them), each once: a tied weight appears under two names."""
    params = module_or_params.parameters() if isinstance(module_or_params, torch.nn.Module) else module_or_params
    return list({id(p): p for p in params}.values())


@dataclass(frozen=True)
class BlockLayout:
    """A [rows, cols] matrix cut into a [rows/|row_axis|, cols/|col_axis|] block, flattened, split over z."""

    rows: int
    cols: int
    row_axis: str
    col_axis: str

    def check(self, grid: Grid, what: str) -> None:
        for n, axis, dim in ((self.rows, self.row_axis, "rows"), (self.cols, self.col_axis, "columns")):
            p = grid.size(axis)
            if n % p:
                raise ValueError(
                    f"{what}: {dim} {n} are not divisible by parallel.{axis}={p}: choose a degree "
                    f"that divides {n}"
                )
        if (self.block_rows(grid) * self.block_cols(grid)) % grid.z:
            raise ValueError(
                f"{what}: a block of {self.block_rows(grid)}x{self.block_cols(grid)} values does not "
                f"split over parallel.z={grid.z}: choose z dividing {self.block_rows(grid) * self.block_cols(grid)}"
            )

    def block_rows(self, grid: Grid) -> int:
        return self.rows // grid.size(self.row_axis)

    def block_cols(self, grid: Grid) -> int:
        return self.cols // grid.size(self.col_axis)

    def shard_numel(self, grid: Grid) -> int:
        return self.block_rows(grid) * self.block_cols(grid) // grid.z

    def local_range(self, grid: Grid) -> tuple[int, int]:
        n = self.shard_numel(grid)
        start = grid.coords["z"] * n
        return start, start + n

    def block_origin(self, grid: Grid, coords: dict | None = None) -> tuple[int, int]:
        c = coords or grid.coords
        return c[self.row_axis] * self.block_rows(grid), c[self.col_axis] * self.block_cols(grid)

    def shard_of(self, full: torch.Tensor, grid: Grid) -> torch.Tensor:
        """This rank's flat shard of a full [rows, cols] tensor."""
        if tuple(full.shape) != (self.rows, self.cols):
            raise ValueError(f"expected a full tensor of shape {(self.rows, self.cols)}, got {tuple(full.shape)}")
        r0, c0 = self.block_origin(grid)
        block = full[r0:r0 + self.block_rows(grid), c0:c0 + self.block_cols(grid)].reshape(-1)
        start, end = self.local_range(grid)
        return block[start:end]

    def gather_full(self, shard: torch.Tensor, grid: Grid) -> torch.Tensor:
        """Collective: every rank of the tensor-parallel group returns the full tensor."""
        block = comm.all_gather(shard.detach().contiguous(), grid, "z")
        blocks = comm.all_gather(block.reshape(1, -1), grid, ("x", "y"))
        full = torch.empty(self.rows, self.cols, dtype=shard.dtype, device=shard.device)
        br, bc = self.block_rows(grid), self.block_cols(grid)
        for i, b in enumerate(blocks):
            coords = dict(grid.coords, x=i % grid.x, y=i // grid.x)
            r0, c0 = self.block_origin(grid, coords)
            full[r0:r0 + br, c0:c0 + bc] = b.view(br, bc)
        return full

    def seeded_normal_shard(self, grid: Grid, std: float, seed: int, name: str,
                            dtype=torch.float32, device=None) -> torch.Tensor:
        """This rank's shard of the full N(0, std^2) matrix defined by (seed, name)."""
        bc = self.block_cols(grid)
        r0, c0 = self.block_origin(grid)
        start, end = self.local_range(grid)
        first, last = start // bc, (end - 1) // bc  # block rows covering the shard
        rows = torch.empty(last - first + 1, bc, dtype=torch.float32)
        key = _name_key(seed, name)
        for tile in range((r0 + first) // TILE_ROWS, (r0 + last) // TILE_ROWS + 1):
            g = torch.Generator().manual_seed(_mix(key, tile))
            values = torch.randn(TILE_ROWS, self.cols, generator=g)
            lo, hi = max(tile * TILE_ROWS, r0 + first), min((tile + 1) * TILE_ROWS, r0 + last + 1)
            rows[lo - r0 - first:hi - r0 - first] = values[lo - tile * TILE_ROWS:hi - tile * TILE_ROWS, c0:c0 + bc]
        flat = rows.reshape(-1)[start - first * bc:end - first * bc]
        return (flat * std).to(dtype=dtype, device=device)


def _name_key(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(key: int, tile: int) -> int:
    """splitmix64 finalizer of (key + tile): decorrelated generator seeds per tile."""
    z = (key + 0x9E3779B97F4A7C15 * (tile + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def full_normal(rows: int, cols: int, std: float, seed: int, name: str) -> torch.Tensor:
    """The full matrix `seeded_normal_shard` cuts from: for single-process references and tests."""
    layout = BlockLayout(rows, cols, "y", "x")
    return layout.seeded_normal_shard(Grid(1, 1, 1, 1), std, seed, name).view(rows, cols)


def seeded_normal_rows(rows, cols: int, col_start: int, col_end: int, std: float, seed: int,
                       name: str) -> torch.Tensor:
    """Rows `rows` (any order), columns [col_start, col_end) of the matrix `seeded_normal_shard` cuts from.

    For layers whose shard gathers rows that are not contiguous in the full matrix (a fused projection
    reordered per head group): each tile is generated once, whatever the order of the requested rows.
    """
    rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    out = torch.empty(len(rows), col_end - col_start, dtype=torch.float32)
    key = _name_key(seed, name)
    tiles = rows // TILE_ROWS
    for tile in torch.unique(tiles).tolist():
        g = torch.Generator().manual_seed(_mix(key, tile))
        values = torch.randn(TILE_ROWS, cols, generator=g)
        pick = (tiles == tile).nonzero().squeeze(1)
        out[pick] = values[rows[pick] - tile * TILE_ROWS, col_start:col_end]
    return out * std
