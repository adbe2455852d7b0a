"""parallel.init() under the three launchers: torchrun, SLURM srun (simulated by its variables), none.

Each case runs a small script in fresh subprocesses (the pytest process never holds a process group): it calls
`parallel.init(x=2)` (or `parallel.init()`), checks the grid, runs an easy-mode Linear forward and backward on
its rows and compares with torch.nn.Linear on one process, then writes its results to result_<rank>.json (not
stdout: torchrun interleaves its ranks' output) for the parent to assert on. Tolerance 1e-5 relative, as in
test_layers.py (fp32, a reduction order change; measured ~1e-7).
Every subprocess has a timeout; the SLURM case rendezvous on a free port picked by binding port 0.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180
TOL = 1e-5
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
               "SLURM_LOCALID")

SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
import parallel
from parallel.sharding import full_normal

x_degree, out_dir = int(sys.argv[1]), sys.argv[2]
grid = parallel.init(x=x_degree, timeout_s=60) if x_degree > 1 else parallel.init(timeout_s=60)
rank, world = dist.get_rank(), dist.get_world_size()
IN, OUT, N = 16, 12, 8
lin = parallel.Linear(IN, OUT, mode="easy", seed=3, name="fc")
ref = torch.nn.Linear(IN, OUT)
with torch.no_grad():
    ref.weight.copy_(full_normal(OUT, IN, 0.02, 3, "fc"))
    ref.bias.zero_()
X = torch.randn(N, IN, generator=torch.Generator().manual_seed(5))
G = torch.randn(N, OUT, generator=torch.Generator().manual_seed(6))
xr = X.clone().requires_grad_()
(ref(xr) * G).sum().backward()
k = N // world
rows = slice(rank * k, (rank + 1) * k)
x = X[rows].clone().requires_grad_()
y = lin(x)
(y * G[rows]).sum().backward()
parallel.sync_gradients(lin, grid)
rel = lambda a, b: float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())
result = {
    "rank": rank, "world": world, "degrees": [grid.data, grid.x, grid.y, grid.z], "grid_rank": grid.rank,
    "backend": dist.get_backend(), "current": parallel.current() is grid,
    "output": rel(y, ref(X)[rows]), "input_grad": rel(x.grad, xr.grad[rows]),
    "weight_grad": rel(lin.layout.gather_full(lin.weight.grad, grid), ref.weight.grad),
}
parallel.shutdown()
result["shutdown"] = not dist.is_initialized()
result["groups_released"] = not grid._groups  # else gloo may abort at interpreter exit
with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
    json.dump(result, f)
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch") / "check_init.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.fixture
def out_dir(tmp_path):
    return tmp_path


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo CPU ranks on any machine (NCCL wants a GPU per rank: test_grid.py)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _results(out_dir):
    return sorted((json.loads(p.read_text()) for p in out_dir.glob("result_*.json")), key=lambda r: r["rank"])


def _check(results, world, degrees):
    assert [r["rank"] for r in results] == list(range(world)), results
    for r in results:
        assert r["world"] == world and r["grid_rank"] == r["rank"] and r["degrees"] == degrees, r
        assert r["backend"] == "gloo" and r["current"] and r["shutdown"] and r["groups_released"], r
        assert max(r["output"], r["input_grad"], r["weight_grad"]) < TOL, r


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun(script, out_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, "2",
           str(out_dir)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(_results(out_dir), 2, [1, 2, 1, 1])


def test_slurm(script, out_dir):
    port = _free_port()
    envs = [_env(SLURM_PROCID=r, SLURM_NTASKS=2, SLURM_LOCALID=r, SLURM_JOB_NODELIST="localhost",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(2)]
    procs = [subprocess.Popen([sys.executable, script, "2", str(out_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env) for env in envs]
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, out + err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    _check(_results(out_dir), 2, [1, 2, 1, 1])


def test_single_process_without_launcher(script, out_dir):
    proc = subprocess.run([sys.executable, script, "1", str(out_dir)], env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(_results(out_dir), 1, [1, 1, 1, 1])
