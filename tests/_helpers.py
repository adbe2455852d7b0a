"""What every multi-rank test shares: the 8-rank grids, the engine's two activation contracts, and the fixtures that
fork them computed once per session (`once_per_session`)."""

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


def once_per_session(request, compute):
    """compute() for a module- or session-scoped fixture, run once per test session even under pytest-xdist.

    Every xdist worker builds its own module fixtures, and `-n 2` spreads one module's tests over both workers:
    the 8-rank fixtures (one fork computing every case of a module) would run twice, or more. The first worker to
    ask computes the value and leaves it pickled in the session's shared temporary directory; another worker
    asking meanwhile waits for it (its cores were busy with that fork anyway) and reads it. Without xdist the
    value is just computed. The value must pickle (run_ranks results do) and must not be changed by tests."""
    import fcntl
    import os
    import pickle

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    root = request.getfixturevalue("tmp_path_factory").getbasetemp().parent / "once-per-session"
    root.mkdir(exist_ok=True)
    # the module's node id for a module fixture, the session's ("") for a session fixture: one value per name
    key = f"{request.node.nodeid or 'session'}::{request.fixturename}".replace("/", ".").replace(":", "-")
    path = root / f"{key}.pickle"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when compute() raises
        if path.is_file():
            return pickle.loads(path.read_bytes())
        value = compute()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(pickle.dumps(value))
        tmp.replace(path)
        return value
