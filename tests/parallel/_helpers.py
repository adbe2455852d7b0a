"""What the engine's layer tests share (test_layers.py, test_autocast_gather.py)."""


def local_rows(grid, mode, n):
    """Rows of the global batch this rank holds: all ranks split it (easy), or data x Z (sharded)."""
    if mode == "easy":
        k = n // grid.world_size
        return slice(grid.rank * k, (grid.rank + 1) * k)
    k = n // grid.size(("z", "data"))
    i = grid.coord(("z", "data"))
    return slice(i * k, (i + 1) * k)
