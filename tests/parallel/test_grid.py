"""The grid: validation before any collective, rank layout and groups at 4096 ranks, per-rank memory.

- resolve_degrees / init / Linear construction errors run in the pytest process, which never holds a
  process group (the tests assert torch.distributed stays uninitialized).
- A fake process group (torch's `fake` backend, no communication) at world size 4096 runs in a forked child,
  so the pytest process keeps no global group: Grid(8, 8, 8, 8) coordinates and groups for a few ranks are
  checked against a brute-force enumeration of rank = x + 8*(y + 8*(z + 8*data)), and a
  Linear(16384, 53248) on device="meta" holds exactly 16384*53248/512 values per rank.
- Memory on a real 8-rank gloo fork: a sharded weight's parameter, gradient and AdamW state bytes per rank
  are exactly 1/(x*y*z) of torch's for the full layer (integers: compared exactly).
"""

import datetime
import itertools
import multiprocessing as mp
import os
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import parallel
from parallel import grid as grid_mod
from parallel.forked import run_ranks
from parallel.grid import first_slurm_host
from tests._helpers import grid_id

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "SLURM_LOCALID")


@pytest.fixture
def no_pg(monkeypatch):
    """A plain process with no launcher variables; fails the test if anything starts a process group."""
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("a process group was created before validation finished")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(dist, "new_group", forbidden)
    assert not dist.is_initialized()
    before = grid_mod._GRID
    yield
    assert not dist.is_initialized()
    assert grid_mod._GRID is before


# ---------------------------------------------------------------- resolve_degrees


@pytest.mark.parametrize("world, degrees, expected", [
    (8, (-1, 2, 2, 1), (2, 2, 2, 1)),
    (8, (2, -1, 2, 1), (2, 2, 2, 1)),
    (8, (1, 1, 1, -1), (1, 1, 1, 8)),
    (16, (2, 2, -1, 2), (2, 2, 2, 2)),
    (4096, (-1, 8, 8, 8), (8, 8, 8, 8)),
    (8, (2, 2, 2, 1), (2, 2, 2, 1)),
    (1, (-1, 1, 1, 1), (1, 1, 1, 1)),
])
def test_resolve_degrees_infers_one(world, degrees, expected):
    assert parallel.resolve_degrees(world, *degrees) == expected


def test_resolve_degrees_product_mismatch_names_values_and_fix():
    with pytest.raises(ValueError) as e:
        parallel.resolve_degrees(8, 1, 3, 1, 1)
    msg = str(e.value)
    for part in ("data=1", "x=3", "y=1", "z=1", "3 ranks", "world size is 8", "product is 8", "-1"):
        assert part in msg, (part, msg)


def test_resolve_degrees_two_inferred_is_an_error():
    with pytest.raises(ValueError, match=r"-1") as e:
        parallel.resolve_degrees(8, -1, -1, 2, 1)
    assert "only one" in str(e.value)


def test_resolve_degrees_inference_must_divide():
    with pytest.raises(ValueError) as e:
        parallel.resolve_degrees(8, -1, 3, 1, 1)
    assert "8" in str(e.value) and "3" in str(e.value) and "data" in str(e.value)


@pytest.mark.parametrize("bad", [0, -2])
def test_resolve_degrees_rejects_nonpositive(bad):
    with pytest.raises(ValueError, match=rf"parallel\.y={bad}"):
        parallel.resolve_degrees(8, 8, 1, bad, 1)


# ---------------------------------------------------------------- init validates before any collective


def test_init_unknown_backend_fails_before_any_collective(no_pg):
    with pytest.raises(ValueError) as e:
        parallel.init(backend="foo")
    assert "'foo'" in str(e.value) and "gloo" in str(e.value)


def test_init_bad_degrees_fail_before_any_collective(no_pg):
    with pytest.raises(ValueError, match=r"world size 1\b"):
        parallel.init(x=3)


def test_nccl_with_more_local_ranks_than_gpus_names_the_rank_and_the_fix(no_pg, monkeypatch):
    """Two torchrun ranks on a one-GPU node: CUDA would say 'invalid device ordinal' from inside NCCL's setup."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 under NCCL, but this node shows 1 GPU.*--nproc-per-node"):
        parallel.init(backend="nccl")


def test_a_grid_without_a_process_group_keeps_its_tensors_on_the_cpu(no_pg, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a visible GPU does not decide it
    assert parallel.Grid(1, 2, 1, 1).device == torch.device("cpu")


def test_slurm_nodelist_first_host():
    assert first_slurm_host("localhost") == "localhost"
    assert first_slurm_host("gpu[003-006,9],login1") == "gpu003"
    assert first_slurm_host("node[7,9-12]") == "node7"
    assert first_slurm_host("a1,b2") == "a1"


@pytest.mark.parametrize("nodelist, host", [
    ("node[01-02]-ib", "node01-ib"), ("node[001-004]-ib,gpu7", "node001-ib"), ("a[1-3,5],b2", "a1"),
    ("rack[1-2]-n[01-04]", "rack1-n01"),
])
def test_slurm_nodelist_first_host_keeps_what_follows_the_brackets(nodelist, host):
    """A suffix after the ranges (an InfiniBand interface's name) was dropped: 'node01' instead of 'node01-ib'."""
    assert first_slurm_host(nodelist) == host


def _launch_env_under_srun(nodelist: dict):
    for var in LAUNCH_VARS:
        os.environ.pop(var, None)
    os.environ.update(SLURM_PROCID="1", SLURM_NTASKS="2", MASTER_ADDR="10.0.0.1", **nodelist)
    return grid_mod._launch_env(), os.environ["MASTER_ADDR"]


@pytest.mark.parametrize("nodelist", [{}, {"SLURM_JOB_NODELIST": "gpu["}], ids=["unset", "unparsable"])
def test_srun_with_master_addr_set_never_parses_the_node_list(nodelist):
    """os.environ.setdefault evaluated first_slurm_host before seeing MASTER_ADDR, so a node list it cannot parse
    (or none) failed a launch that had named its address. In a forked child: _launch_env writes the environment."""
    assert _fork(_launch_env_under_srun, nodelist, timeout=30) == ((1, 2), "10.0.0.1")
    with pytest.raises(ValueError, match=r"SLURM_JOB_NODELIST='gpu\[': set MASTER_ADDR"):
        first_slurm_host("gpu[")


def _stuck_peer(rank, init_file, q):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        time.sleep(15)  # alive, but never joins the collective
        os._exit(0)
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
        q.put(("no error", time.perf_counter() - t0))
    except RuntimeError as e:  # DistBackendError is a RuntimeError
        q.put((type(e).__name__, time.perf_counter() - t0))
    q.close()
    q.join_thread()  # the put is sent by a feeder thread: let it finish before the hard exit
    os._exit(0)  # no atexit handlers: the process group would wait for the stuck peer


def test_a_stuck_rank_becomes_an_error_after_the_process_group_timeout(tmp_path):
    """What parallel.timeout_s buys (the trainer's CPU default is 120 s, not torch's 30 min): a rank that is
    alive but stuck turns into an error on the others once the timeout (3 s here) has passed, not a hang."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_stuck_peer, args=(r, str(tmp_path / "rendezvous"), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        error, seconds = q.get(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert error != "no error" and 2.5 <= seconds <= 12, (error, seconds)


# ---------------------------------------------------------------- Linear divisibility checks


@pytest.mark.parametrize("kwargs, grid, parts", [
    (dict(in_features=64, out_features=96), (1, 3, 1, 1), ("64", "parallel.x=3")),  # in over X
    (dict(in_features=96, out_features=64, transpose=True), (1, 3, 1, 1), ("64", "parallel.x=3")),  # out over X
    (dict(in_features=64, out_features=96, transpose=True), (1, 1, 5, 1), ("64", "parallel.y=5")),  # in over Y
    (dict(in_features=4, out_features=5), (1, 1, 1, 3), ("20", "parallel.z=3")),  # block of 20 over Z
])
def test_linear_not_divisible_names_the_value(no_pg, kwargs, grid, parts):
    for mode in ("easy", "sharded"):
        with pytest.raises(ValueError) as e:
            parallel.Linear(**kwargs, mode=mode, grid=parallel.Grid(*grid, rank=0), name="fc")
        for part in parts + ("fc",):
            assert part in str(e.value), (part, str(e.value))


ONE, X4 = parallel.Grid(1, 1, 1, 1), parallel.Grid(1, 4, 1, 1)


@pytest.mark.parametrize("build, message", [
    (lambda: parallel.Linear(0, 8, grid=ONE, name="fc"), r"^fc: in_features=0 is invalid: use a size of at least 1$"),
    (lambda: parallel.Linear(8, -4, grid=ONE, name="fc"), r"^fc: out_features=-4 is invalid"),
    (lambda: parallel.ColumnEmbedding(16, 10, X4),
     r"^ColumnEmbedding: hidden size 10 is not divisible by parallel.x=4: choose a degree that divides 10$"),
    (lambda: parallel.Linear(4, 4, bias=False, grid=ONE, name="fc").load_full(torch.zeros(4, 4), torch.zeros(4)),
     r"^fc: load_full got a bias for a layer built with bias=False: pass bias=None, or build it with bias=True$"),
    (lambda: parallel.Linear(4, 4, grid=ONE, name="fc").load_full(torch.zeros(4, 4), torch.zeros(3)),
     r"^fc: load_full got a bias of shape \(3,\): the full bias has shape \(4,\)"),
], ids=["no-in-features", "negative-out-features", "column-embedding-over-x", "bias-without-one", "bias-shape"])
def test_bad_layer_arguments_fail_in_one_line(no_pg, build, message):
    """Each once failed deep inside (ZeroDivisionError in the seeded initialization, AttributeError on a missing
    bias, a broadcast error) or, for ColumnEmbedding, built a [16, 2] slice of a hidden size x=4 does not split."""
    with pytest.raises(ValueError, match=message):
        build()


# ---------------------------------------------------------------- 4096 ranks on a fake process group


def _fork(fn, *args, timeout=120.0):
    """Run fn(*args) in a forked child and return its result (the child's process group dies with it)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def target():
        try:
            q.put(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001
            q.put(("error", traceback.format_exc()))

    p = ctx.Process(target=target)
    p.start()
    try:
        status, payload = q.get(timeout=timeout)
    except queue.Empty:
        status, payload = "error", f"child timed out after {timeout} s"
    finally:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


FAKE_WORLD = 4096
FAKE_RANKS = (0, 1, 8, 777, 1234, 2048, 4095)


def _fake_pg_child(degrees, ranks):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = {}
    for r in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=FAKE_WORLD)
        g = parallel.Grid(*degrees, rank=r)
        g.build_groups()
        groups = {}
        for key, pg in g._groups.items():
            groups[key] = {"pg_ranks": sorted(dist.get_process_group_ranks(pg)), "pg_rank": dist.get_rank(pg),
                           "grid_ranks": g.group_ranks(key), "coord": g.coord(key), "is_world": pg is dist.group.WORLD}
        trivial = [a for a in parallel.AXES if getattr(g, a) == 1]
        lin = parallel.Linear(16384, 53248, mode="sharded", grid=g, device="meta", name="big")
        lint = parallel.Linear(53248, 16384, mode="sharded", transpose=True, grid=g, device="meta", name="bigT")
        out[r] = {"coords": g.coords, "groups": groups, "trivial_none": all(g.group(a) is None for a in trivial),
                  "shard": tuple(lin.weight.shape), "shard_t": tuple(lint.weight.shape),
                  "device": lin.weight.device.type}
        dist.destroy_process_group()
    return out


def _expected_members(degrees, rank, axes):
    data, x, y, z = degrees
    size = dict(data=data, x=x, y=y, z=z)

    def coords(r):
        return dict(x=r % x, y=r // x % y, z=r // (x * y) % z, data=r // (x * y * z))

    me = coords(rank)
    return [r for r in range(data * x * y * z)
            if all(coords(r)[a] == me[a] for a in parallel.AXES if a not in axes and size[a] > 1)]


@pytest.fixture(scope="module")
def fake_results():
    return {degrees: _fork(_fake_pg_child, degrees, FAKE_RANKS) for degrees in [(8, 8, 8, 8), (64, 8, 8, 1)]}


@pytest.mark.parametrize("degrees", [(8, 8, 8, 8), (64, 8, 8, 1)], ids=["d8x8y8z8", "d64x8y8z1"])
def test_fake_pg_4096_groups(fake_results, degrees):
    data, x, y, z = degrees
    size = dict(data=data, x=x, y=y, z=z)
    live = [a for a in parallel.AXES if size[a] > 1]
    combos = {c for n in range(1, len(live) + 1) for c in itertools.combinations(live, n)}
    for r, got in fake_results[degrees].items():
        assert got["coords"] == dict(x=r % x, y=r // x % y, z=r // (x * y) % z, data=r // (x * y * z))
        assert set(got["groups"]) == combos  # every non-trivial combination, nothing else
        assert got["trivial_none"]
        for key, g in got["groups"].items():
            expected = _expected_members(degrees, r, key)
            assert g["grid_ranks"] == expected, (r, key)
            assert g["pg_ranks"] == expected, (r, key)
            # group order = X fastest, then Y, Z, data: this rank's index in the group is its coord
            assert g["pg_rank"] == g["coord"] == expected.index(r), (r, key)
            assert g["is_world"] == (len(expected) == FAKE_WORLD)
        for axis, stride in (("x", 1), ("y", x), ("z", x * y), ("data", x * y * z)):
            if size[axis] > 1:
                first = r - got["coords"][axis] * stride
                assert got["groups"][(axis,)]["pg_ranks"] == [first + i * stride for i in range(size[axis])]


def test_fake_pg_4096_meta_linear_shard(fake_results):
    for got in fake_results[(8, 8, 8, 8)].values():
        assert got["device"] == "meta"
        assert got["shard"] == got["shard_t"] == (16384 * 53248 // 512,)
    for got in fake_results[(64, 8, 8, 1)].values():
        assert got["shard"] == got["shard_t"] == (16384 * 53248 // 64,)


# ---------------------------------------------------------------- memory per rank (real 8-rank fork)

MEM_GRIDS = [(1, 2, 2, 2), (2, 2, 2, 1)]
IN, OUT, ROWS = 64, 96, 8


def _nbytes(t):
    return t.numel() * t.element_size()


def _memory(lin_or_ref, opt):
    w = lin_or_ref.weight
    state = opt.state[w]
    return {"param": _nbytes(w), "grad": _nbytes(w.grad),
            "state": sum(_nbytes(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0),
            "state_keys": sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0),
            "scalar_keys": sorted(k for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0)}


def _step(module, x):
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    module(x).square().sum().backward()
    return opt


def _memory_worker(rank, world):
    out = {}
    for degrees in MEM_GRIDS:
        grid = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        for mode in ("sharded", "easy"):
            lin = parallel.Linear(IN, OUT, bias=False, mode=mode, grid=grid, name="fc")
            opt = _step(lin, torch.randn(ROWS, lin.local_in_features))
            parallel.sync_gradients(lin, grid)
            opt.step()
            out[(degrees, mode)] = _memory(lin, opt)
    return out


@pytest.fixture(scope="module")
def memory_results():
    ref = torch.nn.Linear(IN, OUT, bias=False)
    opt = _step(ref, torch.randn(ROWS, IN))
    opt.step()
    return _memory(ref, opt), run_ranks(8, _memory_worker)


@pytest.mark.parametrize("mode", ["sharded", "easy"])
@pytest.mark.parametrize("degrees", MEM_GRIDS, ids=grid_id)
def test_sharded_weight_memory_is_one_over_xyz(memory_results, degrees, mode):
    full, per_rank = memory_results
    _, x, y, z = degrees
    assert full["param"] == IN * OUT * 4 and full["state_keys"] == ["exp_avg", "exp_avg_sq"]
    for rank, res in enumerate(per_rank):
        got = res[(degrees, mode)]
        assert got["state_keys"] == full["state_keys"] and got["scalar_keys"] == full["scalar_keys"]
        for kind in ("param", "grad", "state"):
            assert got[kind] * x * y * z == full[kind], (rank, kind, got[kind], full[kind])
