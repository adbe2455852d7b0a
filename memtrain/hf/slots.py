"""How full HF tensors map onto this rank's shards: slots, lazy sources, and the module builder.

A slot ties one HF state-dict entry to the engine tensor holding (part of) it, and knows the three
ways that tensor gets its values: drawn from the seed, loaded from full HF tensors, gathered back.
- MatrixSlot: an engine weight (Linear, Embedding, LM head); its rows may be reordered (GPT-2's fused
  QKV), padded (vocabulary) or stored transposed in HF (Conv1D).
- PartSlot: a tensor held whole or cut along its last dimension (norms, biases, GPT-2's wpe).
The Builder replaces HF modules by engine ones (built on the meta device) and records their slots;
parallelize.py then gives them storage. Sources read safetensors lazily, slice by slice, so a rank
never holds more of a checkpoint than its own block.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

import parallel
from parallel import comm
from parallel.sharding import seeded_normal_rows

# --------------------------------------------------------------------------------------------------
# Full HF tensors, from a dict or from safetensors files read slice by slice.


class Source:
    """Full HF tensors by name: a dict, or *.safetensors files (one, or a directory) opened lazily."""

    def __init__(self, obj):
        self._stack, self._dict, self._handles = ExitStack(), None, {}
        if isinstance(obj, dict):
            self._dict = obj
            return
        from safetensors import safe_open

        path = Path(obj)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise FileNotFoundError(f"{str(path)!r} holds no *.safetensors weights: save the model with "
                                    "save_pretrained(safe_serialization=True) or pass a state dict")
        for f in files:
            try:
                h = self._stack.enter_context(safe_open(str(f), framework="pt"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
                self.close()
                raise ValueError(f"weights file {str(f)!r} is not readable safetensors ({type(e).__name__}: {e}): "
                                 "restore it, or save the model again") from None
            self._handles.update({k: h for k in h.keys()})

    def keys(self) -> list[str]:
        return list(self._dict) if self._dict is not None else list(self._handles)

    def shape(self, key) -> tuple[int, ...]:
        if self._dict is not None:
            return tuple(self._dict[key].shape)
        return tuple(self._handles[key].get_slice(key).get_shape())

    def read(self, key, index=None) -> torch.Tensor:
        if self._dict is not None:
            t = self._dict[key]
            return t[index] if index is not None else t
        h = self._handles[key]
        return h.get_slice(key)[index] if index is not None else h.get_tensor(key)

    def close(self):
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous runs [a, b) of an index list, so a permuted read is a few slices, not one per row."""
    idx = idx.tolist()
    runs, start = [], 0
    for i in range(1, len(idx) + 1):
        if i == len(idx) or idx[i] != idx[i - 1] + 1:
            runs.append((idx[start], idx[i - 1] + 1))
            start = i
    return runs


def _fill(param: torch.Tensor, value: torch.Tensor) -> None:
    """Give a (meta) parameter real storage in place: ties and ShardSpec tags survive."""
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, new)


# --------------------------------------------------------------------------------------------------
# Slots: one HF tensor <-> this rank's piece of it.


class MatrixSlot:
    """An engine weight (Linear, Embedding, LM head) holding the HF matrix `key`.

    Engine rows are output features (Linear orientation). `hf_rows[r]` is the HF row of engine row r
    (a fused projection reordered per head group); rows >= `valid` are vocabulary padding; `conv1d`:
    the HF tensor is stored [in, out] (GPT-2).
    """

    def __init__(self, key, layer, *, std, hf_rows=None, valid=None, conv1d=False, zero_row=None):
        self.key, self.layer, self.std, self.hf_rows, self.conv1d = key, layer, std, hf_rows, conv1d
        self.zero_row = zero_row  # an embedding's padding_idx: HF initializes that row to zero
        self.valid = layer.layout.rows if valid is None else valid
        cols = layer.layout.cols
        self.full_shape = (cols, self.valid) if conv1d else (self.valid, cols)

    def _rows(self):
        """(engine rows covering this rank's shard, first column, their offset into the shard)."""
        lay, grid = self.layer.layout, self.layer.grid
        bc = lay.block_cols(grid)
        r0, c0 = lay.block_origin(grid)
        start, end = lay.local_range(grid)
        first, last = start // bc, (end - 1) // bc
        return torch.arange(r0 + first, r0 + last + 1), c0, bc, start - first * bc, end - first * bc

    def _block(self, fetch) -> torch.Tensor:
        rows, c0, bc, a, b = self._rows()
        out = torch.zeros(len(rows), bc, dtype=torch.float32)
        keep = rows < self.valid
        hf = rows[keep] if self.hf_rows is None else self.hf_rows[rows[keep]]
        if len(hf):
            out[keep] = fetch(hf, c0, c0 + bc).float()
        return out.reshape(-1)[a:b]

    def materialize(self, seed: int, seeded: bool, device) -> None:
        w = self.layer.weight
        if seeded:
            cols = self.layer.layout.cols

            def draw(hf, c0, c1):
                values = seeded_normal_rows(hf, cols, c0, c1, self.std, seed, self.key)
                if self.zero_row is not None:
                    values[hf == self.zero_row] = 0
                return values

            shard = self._block(draw)
            _fill(w, shard.to(device=device, dtype=w.dtype))
        else:
            _fill(w, torch.empty(w.shape, device=device, dtype=w.dtype))

    @torch.no_grad()
    def load(self, src: Source, key: str) -> None:
        def fetch(hf, c0, c1):
            parts = []
            for a, b in _runs(hf):
                if self.conv1d:
                    parts.append(src.read(key, (slice(c0, c1), slice(a, b))).t())
                else:
                    parts.append(src.read(key, (slice(a, b), slice(c0, c1))))
            return torch.cat(parts)

        w = self.layer.weight
        w.copy_(self._block(fetch).to(device=w.device, dtype=w.dtype))

    @property
    def tensor(self) -> torch.Tensor:
        return self.layer.weight

    def pieces(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """This rank's values as (offset into the HF tensor, rectangle) pairs, with no communication; none on a
        data-parallel replica. The Z split of a flattened block may start and end mid-row, and a reordered
        projection sends runs of engine rows to runs of HF rows: so a shard is a few full-row rectangles and
        at most two partial rows, each a view of the shard (a copy only for GPT-2's transposed Conv1D)."""
        lay, grid = self.layer.layout, self.layer.grid
        if grid.coords["data"]:
            return []
        w = self.layer.weight.detach()
        bc = lay.block_cols(grid)
        r0, c0 = lay.block_origin(grid)
        start, end = lay.local_range(grid)
        out, pos = [], start
        while pos < end:
            r, c = divmod(pos, bc)
            k, n = ((end - pos) // bc, bc) if c == 0 and end - pos >= bc else (1, min(bc - c, end - pos))
            rows = torch.arange(r0 + r, r0 + r + k)
            rows = rows[rows < self.valid]  # vocabulary padding is not part of the HF tensor
            values = w[pos - start:pos - start + k * n].view(k, n)
            hf = rows if self.hf_rows is None else self.hf_rows[rows]
            i = 0
            for a, b in _runs(hf):
                block = values[i:i + b - a]
                out.append(((c0 + c, a), block.t().contiguous()) if self.conv1d else ((a, c0 + c), block))
                i += b - a
            pos += k * n
        return out

    def save(self) -> torch.Tensor:
        full = self.layer.full_weight()[:self.valid]
        if self.hf_rows is not None:
            out = torch.empty_like(full)
            out[self.hf_rows] = full
            full = out
        return full.t().contiguous() if self.conv1d else full


class PartSlot:
    """A tensor held whole or sliced along its last dimension over one axis (norms, biases, wpe).

    init: None keeps the model's value; "ones"/"zeros"; "normal" draws the seeded matrix (2-D).
    The tensor is looked up on its module at every use, so swapped `.data` (checkpoint I/O) is honoured.
    """

    def __init__(self, key, module, attr, grid, *, full_shape, axis=None, hf_index=None, init=None, std=0.02):
        self.key, self.module, self.attr, self.grid, self.axis = key, module, attr, grid, axis
        self.full_shape, self.hf_index, self.init, self.std = tuple(full_shape), hf_index, init, std

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    def _local(self, full: torch.Tensor) -> torch.Tensor:
        if self.hf_index is not None:
            full = full.index_select(-1, self.hf_index)
        if self.axis is None:
            return full
        n = full.shape[-1] // self.grid.size(self.axis)
        return full.narrow(-1, self.grid.coord(self.axis) * n, n)

    def materialize(self, seed: int, seeded: bool, device) -> None:
        t = self.tensor
        draw = seeded and self.init is not None
        if t.device.type != "meta" and not draw:
            return  # a real tensor of the model, kept
        if not draw:
            value = torch.empty(t.shape)  # a checkpoint fills it next
        elif self.init in ("ones", "zeros"):
            value = (torch.ones if self.init == "ones" else torch.zeros)(t.shape)
        else:  # "normal": a 2-D [rows, cols] table, this rank's columns
            rows, cols = self.full_shape
            n = t.shape[-1]
            c0 = self.grid.coord(self.axis) * n if self.axis else 0
            value = seeded_normal_rows(torch.arange(rows), cols, c0, c0 + n, self.std, seed, self.key)
        value = value.to(device=device if t.device.type == "meta" else t.device, dtype=t.dtype)
        if isinstance(t, nn.Parameter):
            _fill(t, value)
        else:
            t.copy_(value)

    @torch.no_grad()
    def load(self, src: Source, key: str) -> None:
        t = self.tensor
        if self.hf_index is None and self.axis is not None:  # read this rank's slice only
            n = t.shape[-1]
            c0 = self.grid.coord(self.axis) * n
            value = src.read(key, (slice(None),) * (t.dim() - 1) + (slice(c0, c0 + n),))
        else:
            value = self._local(src.read(key))
        t.copy_(value.to(device=t.device, dtype=t.dtype))

    def pieces(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """As MatrixSlot.pieces: this rank's slice along the last dimension (in runs of HF indices), written by
        the ranks at coordinate 0 of every axis that replicates it."""
        if any(self.grid.coords[a] for a in parallel.AXES if a != self.axis):
            return []
        t = self.tensor.detach()
        n = t.shape[-1]
        c0 = self.grid.coord(self.axis) * n if self.axis else 0
        index = torch.arange(c0, c0 + n) if self.hf_index is None else self.hf_index[c0:c0 + n]
        out, j = [], 0
        for a, b in _runs(index):
            out.append(((0,) * (t.dim() - 1) + (a,), t[..., j:j + b - a]))
            j += b - a
        return out

    def save(self) -> torch.Tensor:
        t = self.tensor.detach()
        if self.axis is not None:
            t = comm.all_gather(t.movedim(-1, 0).contiguous(), self.grid, self.axis).movedim(0, -1)
        if self.hf_index is not None:
            out = torch.empty_like(t)
            out[..., self.hf_index] = t
            t = out
        return t.contiguous().clone()


# --------------------------------------------------------------------------------------------------
# Building: replace modules, record slots, then give everything storage.


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def check_divisible(what: str, value: int, grid, axis: str, role: str) -> None:
    p = grid.size(axis)
    if value % p:
        raise ValueError(f"{what}={value} is not divisible by parallel.{axis}={p} ({role}): choose "
                         f"parallel.{axis} among {_divisors(value)}, or use mode='easy'")


class Builder:
    """Replaces modules of `model` with engine layers (on meta) and records how each maps to HF names."""

    def __init__(self, model, grid, mode: str, dtype, std_of):
        self.model, self.grid, self.mode, self.dtype, self.std_of = model, grid, mode, dtype, std_of
        self.slots: list = []
        self.head = None

    def replace(self, path: str, module: nn.Module) -> None:
        parent, _, name = path.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, name, module)

    def linear(self, path: str, *, transpose: bool = False, hf_rows=None) -> parallel.Linear:
        from transformers.pytorch_utils import Conv1D

        old = self.model.get_submodule(path)
        conv1d = isinstance(old, Conv1D)
        n_in, n_out = tuple(old.weight.shape) if conv1d else (old.in_features, old.out_features)
        layer = parallel.Linear(n_in, n_out, bias=old.bias is not None, transpose=transpose, mode=self.mode,
                                grid=self.grid, name=path, device="meta", dtype=self.dtype)
        self.replace(path, layer)
        key = path + ".weight"
        self.slots.append(MatrixSlot(key, layer, std=self.std_of(key), hf_rows=hf_rows, conv1d=conv1d))
        if old.bias is not None:
            self.slots.append(PartSlot(path + ".bias", layer, "bias", self.grid, full_shape=(n_out,),
                                       axis=layer.out_axis, hf_index=hf_rows, init="zeros"))
        return layer

    def embedding(self, path: str) -> parallel.Embedding:
        old = self.model.get_submodule(path)
        vocab, hidden = old.weight.shape
        emb = parallel.Embedding(parallel.padded_vocab(vocab, hidden, self.grid), hidden,
                                 padding_idx=getattr(old, "padding_idx", None), valid=vocab, mode=self.mode,
                                 grid=self.grid, name=path, device="meta", dtype=self.dtype)
        self.replace(path, emb)
        key = path + ".weight"
        self.slots.append(MatrixSlot(key, emb, std=self.std_of(key), valid=vocab, zero_row=emb.padding_idx))
        return emb

    def lm_head(self, path: str, tie_to: parallel.Embedding | None) -> parallel.LMHead:
        old = self.model.get_submodule(path)
        if getattr(old, "bias", None) is not None:
            raise ValueError(f"{path} has a bias: LM heads with a bias are not supported")
        vocab, hidden = old.weight.shape
        head = parallel.LMHead(hidden, parallel.padded_vocab(vocab, hidden, self.grid), valid=vocab, tie_to=tie_to,
                               mode=self.mode, grid=self.grid, name=path, device="meta", dtype=self.dtype)
        self.replace(path, head)
        if tie_to is None:
            key = path + ".weight"
            self.slots.append(MatrixSlot(key, head, std=self.std_of(key), valid=vocab))
        self.head = head
        return head

    def norm(self, path: str) -> nn.Module:
        from parallel.norm import LayerNorm, RMSNorm

        old = self.model.get_submodule(path)
        hidden = old.weight.shape[0]
        if isinstance(old, nn.LayerNorm):
            new = LayerNorm(hidden, old.eps, bias=old.bias is not None, grid=self.grid, device="meta",
                            dtype=self.dtype, name=path)
        elif "RMSNorm" in type(old).__name__:
            eps = getattr(old, "variance_epsilon", getattr(old, "eps", 1e-6))
            new = RMSNorm(hidden, eps, grid=self.grid, device="meta", dtype=self.dtype, name=path)
        else:
            raise ValueError(f"{path}: cannot shard a {type(old).__name__}")
        self.replace(path, new)
        for attr, init in (("weight", "ones"), ("bias", "zeros")):
            if getattr(new, attr, None) is not None:
                self.slots.append(PartSlot(f"{path}.{attr}", new, attr, self.grid, full_shape=(hidden,), axis="x",
                                           init=init))
        return new

    def part(self, key: str, module: nn.Module, attr: str, **kw) -> None:
        self.slots.append(PartSlot(key, module, attr, self.grid, **kw))
