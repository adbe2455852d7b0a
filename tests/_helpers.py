"""What every multi-rank test shares: the 8-rank grids and the engine's two activation contracts."""

# Every (data, x, y, z) family of 8 ranks: each axis alone, and the mixed 2x2x2 layouts.
GRIDS = [(8, 1, 1, 1), (1, 8, 1, 1), (1, 1, 8, 1), (1, 1, 1, 8), (2, 2, 2, 1), (1, 2, 2, 2), (2, 1, 2, 2),
         (2, 2, 1, 2)]
MODES = ("sharded", "easy")


def grid_id(degrees) -> str:
    """A test id for a grid: d2x2y1z2."""
    return "d{}x{}y{}z{}".format(*degrees)


# A Linear's switches: (transpose, bias, overlap).
LINEAR_OPTIONS = [(t, b, ov) for t in (False, True) for b in (False, True) for ov in (False, True)]


def built_grids(rank: int):
    """(degrees, grid with its process groups) of every 8-rank grid, for this rank of a forked world."""
    import parallel

    for degrees in GRIDS:
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        yield degrees, grid


class GridCache(dict):
    """Built grids by degrees for one rank of a forked world: the cases of a worker that share a grid share its
    process groups (each new group is a collective over the world)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def __missing__(self, degrees):
        import parallel

        grid = self[degrees] = parallel.Grid(*degrees, rank=self.rank)
        grid.build_groups()
        return grid
