"""The MLP stack and the training variants `python -m experiments.bench.engine` times on it.

Every variant builds the same residual MLP (`--layers` blocks of x + Linear(4H -> H)(GELU(Linear(H -> 4H)(x))))
from the same full weights, `full_params`: memtrain's grid-independent seeded init, which the torch models load.
A variant owns its model, its AdamW and its rank's slice of the batch; `step()` is the unit the benchmark times.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch import nn

import parallel
from experiments.bench.common import fsdp2, param_opt_bytes
from parallel.sharding import full_normal

SEED = 1234


# ----------------------------------------------------------------------------------------------- model

def full_params(hidden: int, layers: int):
    """The full initial weights and biases every variant starts from: {name: (W [out, in], b [out])}."""
    out = {}
    g = torch.Generator().manual_seed(SEED + 1)
    for i in range(layers):
        for name, (fin, fout) in ((f"block{i}.fc1", (hidden, 4 * hidden)), (f"block{i}.fc2", (4 * hidden, hidden))):
            w = full_normal(fout, fin, fin ** -0.5, SEED, name)
            b = 0.02 * torch.randn(fout, generator=g)
            out[name] = (w, b)
    return out


class Block(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def torch_mlp(hidden: int, layers: int, init) -> nn.Sequential:
    blocks = []
    for i in range(layers):
        fc1, fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        with torch.no_grad():
            for lin, name in ((fc1, f"block{i}.fc1"), (fc2, f"block{i}.fc2")):
                lin.weight.copy_(init[name][0])
                lin.bias.copy_(init[name][1])
        blocks.append(Block(fc1, fc2))
    return nn.Sequential(*blocks)


def memtrain_mlp(grid: parallel.Grid, hidden: int, layers: int, mode: str, init) -> nn.Sequential:
    blocks = []
    for i in range(layers):
        fc1 = parallel.Linear(hidden, 4 * hidden, mode=mode, grid=grid, seed=SEED, name=f"block{i}.fc1",
                              init_std=hidden ** -0.5)
        fc2 = parallel.Linear(4 * hidden, hidden, mode=mode, grid=grid, seed=SEED, name=f"block{i}.fc2",
                              transpose=(mode == "sharded"), init_std=(4 * hidden) ** -0.5)
        for lin in (fc1, fc2):
            lin.load_full(*init[lin.name])  # same values as the seeded init (checked), plus the biases
        blocks.append(Block(fc1, fc2))
    return nn.Sequential(*blocks)


# -------------------------------------------------------------------------------------------- variants

class Variant:
    """One model + optimizer + data slice; `step()` is the timed unit and returns this rank's loss term."""

    name = ""
    grid: parallel.Grid | None = None

    def __init__(self, rank, world, args, init, X, T):
        self.rank, self.world, self.args = rank, world, args
        self.n_rows, self.hidden = X.shape
        self.build(init, X, T)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)

    def loss_fn(self, y):
        raise NotImplementedError

    def step(self) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.model(self.x)
        loss = self.loss_fn(y)
        loss.backward()  # DDP/FSDP2 sync inside backward
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.phases = (t1 - t0, 0.0, time.perf_counter() - t1)
        return loss.detach() * self.report_weight

    def comm_model(self) -> dict:
        return {}


class DDPVariant(Variant):
    name = "ddp"

    def build(self, init, X, T):
        k = self.n_rows // self.world  # each rank its own rows, all features
        rows = slice(self.rank * k, (self.rank + 1) * k)
        self.x, self.t = X[rows].contiguous(), T[rows].contiguous()
        self.model = self.wrap(torch_mlp(self.hidden, self.args.layers, init))
        self.report_weight = 1.0 / self.world

    def wrap(self, model: nn.Sequential) -> nn.Module:
        return nn.parallel.DistributedDataParallel(model)

    def loss_fn(self, y):
        return nn.functional.mse_loss(y, self.t)  # DDP averages gradients over ranks -> global mean

    def comm_model(self):
        p = self.world
        m = param_opt_bytes(self.model, self.opt)[0]
        return {"all_reduce data (model)": (m, 2 * (p - 1) / p * m)}


class FSDP2Variant(DDPVariant):
    name = "fsdp2"

    def wrap(self, model: nn.Sequential) -> nn.Module:
        return fsdp2(model, list(model), self.world)

    def comm_model(self):
        p = self.world
        m = param_opt_bytes(self.model, self.opt)[0] * p  # unsharded fp32 bytes
        return {"all_gather (fwd+bwd) (model)": (2 * m, 2 * (p - 1) / p * m),
                "reduce_scatter (model)": (m, (p - 1) / p * m)}


class MemtrainVariant(Variant):
    degrees = (1, 1, 1, 1)  # data, x, y, z
    mode = "easy"
    use_overlap = False
    grad_sync = "overlap"  # or "blocking"

    def build(self, init, X, T):
        self.grid = parallel.Grid(*self.degrees, rank=self.rank)
        self.grid.build_groups()
        g = self.grid
        self.model = memtrain_mlp(g, self.hidden, self.args.layers, self.mode, init)
        if self.mode == "easy":  # each rank its own rows, all features
            k = self.n_rows // g.world_size
            rows, cols = slice(g.rank * k, (g.rank + 1) * k), slice(None)
            self.report_weight = 1.0
        else:  # rows split over (z, data); a block's input/output is [rows, H/x] replicated over y
            k = self.n_rows // g.size(("z", "data"))
            i = g.coord(("z", "data"))
            rows = slice(i * k, (i + 1) * k)
            f = self.hidden // g.x
            cols = slice(g.coords["x"] * f, (g.coords["x"] + 1) * f)
            self.report_weight = 1.0 if g.coords["y"] == 0 else 0.0  # count each replica once
        self.x, self.t = X[rows, cols].contiguous(), T[rows, cols].contiguous()
        self.scale = 1.0 / (self.n_rows * self.hidden)  # grads are summed: normalize by the global count
        self.sync = parallel.grad_sync(self.model, g) if self.grad_sync == "overlap" else None

    def loss_fn(self, y):
        return (y - self.t).pow(2).sum() * self.scale

    def step(self):
        t0 = time.perf_counter()
        if self.sync is not None:
            self.sync.start()  # backward launches the bucket all-reduces
        with parallel.overlap(self.model) if self.use_overlap else nullcontext():
            loss = self.loss_fn(self.model(self.x))
            loss.backward()
        t1 = time.perf_counter()
        if self.sync is not None:
            self.sync.finish()  # the rest launched, all waited, sums copied into .grad
        else:
            parallel.sync_gradients(self.model, self.grid)
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.phases = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        return loss.detach() * self.report_weight


def _memtrain(name, degrees, mode="easy", use_overlap=False, grad_sync="overlap"):
    return type(name, (MemtrainVariant,), {"name": name, "degrees": degrees, "mode": mode,
                                           "use_overlap": use_overlap, "grad_sync": grad_sync})


def make_variants(world):
    return {
        "ddp": DDPVariant,
        "mt-data": _memtrain("mt-data", (world, 1, 1, 1)),
        "mt-data-blocking": _memtrain("mt-data-blocking", (world, 1, 1, 1), grad_sync="blocking"),
        "fsdp2": FSDP2Variant,
        "mt-z": _memtrain("mt-z", (1, 1, 1, world)),
        "mt-z+ov": _memtrain("mt-z+ov", (1, 1, 1, world), use_overlap=True),
        "mt-x2y2-sh": _memtrain("mt-x2y2-sh", (world // 4, 2, 2, 1), mode="sharded"),
        "mt-x2z2-easy": _memtrain("mt-x2z2-easy", (world // 4, 2, 1, 2)),
    }
