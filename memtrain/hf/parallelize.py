"""Turn a transformers causal LM into a model sharded over the 4D grid (torchtitan style).

    model = build_model("ladder-10m", vocab_size=4096, device="meta")
    plm = parallelize(model, grid, mode="auto", seed=0)
    losses = plm.token_losses(input_ids[plm.local_rows(B)], labels[plm.local_rows(B)])   # [b, S]

The model code stays HF's: parallelize REPLACES modules of a constructed model (on any device, meta
included) with the engine's, and HF's forward runs through them unchanged.
- sharded mode (Llama, GPT-NeoX, GPT-2; plans in architectures.py): the residual stream is
  [rows, H/x] replicated over Y, heads split over Y, norms sharded over X; rows split over (z, data).
- easy mode (any model): every nn.Linear / GPT-2 Conv1D becomes an easy-mode parallel.Linear that takes
  and returns plain data-parallel activations; the rest stays replicated. Rows split over all ranks.
Both: vocabulary-parallel embedding and LM head (`LMHead.loss`: logits never whole on one rank).

Weights are defined in HF coordinates, so the same (seed, config) gives the same full model on every
grid and in both modes: each weight the engine owns is drawn tile by tile from a generator seeded by
(seed, HF name) (parallel.sharding), each rank drawing only the rows it stores. A full HF state dict
(tensors, or safetensors read lazily by slice) loads into any grid, and `full_state_dict` gathers any
grid back to HF names and layouts (Conv1D [in, out], fused QKV order, unpadded vocabulary).

The vocabulary is padded to a multiple of Y (and so the table splits over Z) when needed. Padded rows
are zero, absent from HF state dicts, and their logits are set to -1e30 before the softmax, so they
take exactly zero probability and the loss equals the unpadded model's.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn

import parallel
from eval.decode import stateful
from memtrain.config import PARALLEL_MODES
from memtrain.files import atomic_dir
from memtrain.hf import blocks, documents
from memtrain.hf.architectures import ARCHITECTURES, Architecture, architecture_of
from memtrain.hf.materialize import keep_leftovers, materialize
from memtrain.hf.slots import Builder, Source
from parallel import comm
from parallel.sharding import is_tagged

WEIGHTS = ("auto", "seed", "model")


class ParallelLM(nn.Module):
    """A parallelized causal LM: per-token losses of this rank's rows, full HF state dicts in and out."""

    def __init__(self, model, grid, mode: str, arch: Architecture, builder: Builder, keys: list[str],
                 tied: list[str], num_params: int):
        super().__init__()
        self.model, self.grid, self.mode = model, grid, mode
        object.__setattr__(self, "head", builder.head)  # a module of self.model already: register once
        self._slots = {s.key: s for s in builder.slots}
        self._keys, self._tied, self._num_params = keys, set(tied), num_params
        self._aliases = {k: arch.aliases(model, k) for k in keys}
        dropout = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        if getattr(model.config, "attention_dropout", 0):
            dropout.append("config.attention_dropout")
        self._dropout = dropout
        self._document_mask = False  # isolate_documents: the engine builds the mask from position ids
        self._compiled_blocks, self._blocks_checkpointed = 0, False

    @property
    def config(self):
        return self.model.config

    @property
    def row_axes(self) -> tuple[str, ...]:
        """Axes over which this model's rows differ (all of them in easy mode, (z, data) in sharded mode):
        token-loss sums are all-reduced, and decoded rows all-gathered, over them."""
        return parallel.AXES if self.mode == "easy" else ("z", "data")

    def local_rows(self, global_batch_size: int) -> slice:
        """This rank's rows of every global batch: split over all ranks (easy) or over (z, data)."""
        if self.mode == "easy":
            p, i = self.grid.world_size, self.grid.rank
        else:
            p, i = self.grid.size(("z", "data")), self.grid.coord(("z", "data"))
        if global_batch_size % p:
            raise ValueError(f"batch of {global_batch_size} rows does not split over {p} "
                             f"{'ranks' if self.mode == 'easy' else 'z x data groups'} ({self.mode} mode): "
                             f"use a multiple of {p}")
        k = global_batch_size // p
        return slice(i * k, (i + 1) * k)

    def token_losses(self, input_ids: torch.Tensor, labels: torch.Tensor,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token cross-entropy [b, S] of this rank's rows; labels[:, j] is the target of position j
        (already shifted), -100 gives 0. In sharded mode the result is replicated over X and Y.
        position_ids that restart inside a row make each restarted run a document of its own: transformers
        then masks attention block-diagonally (its packed-sequence path, or the engine's mask: isolate_documents)."""
        if self.training and self.mode == "sharded" and self._dropout:
            raise ValueError(f"{type(self.model).__name__} has dropout ({self._dropout[0]}) in training: sharded "
                             "mode replicates activations over Y, which would need identical masks on every "
                             "replica; set the config's dropout fields to 0 (e.g. build_model(name, attn_pdrop=0.0, "
                             "resid_pdrop=0.0, embd_pdrop=0.0)), call .eval(), or use mode='easy'")
        mask = None
        if self._document_mask and position_ids is not None:
            mask = documents.block_causal_mask(position_ids, self.config._attn_implementation,
                                               next(self.parameters()).dtype)
        out = self.model.base_model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                    use_cache=False)
        return self.head.loss(out[0], labels)

    forward = token_losses

    @torch.no_grad()
    def isolate_documents(self) -> bool:
        """Make position ids that restart inside a row keep its documents apart, and say whether they now do
        (collective, every rank scoring rows of its own): transformers' own packed-sequence mask where the family
        reads position ids, else the engine's block-causal mask (hf/documents.py); False where neither does."""
        if stateful(self.model):  # a recurrence carries a row's state across its documents, whatever the mask
            return False
        was, device = self.training, self.grid.device
        self.eval()  # dropout would move the losses too
        documents.alibi_from_documents(self.model.base_model)
        try:
            for prepared in (False, True):
                if prepared and self.config._attn_implementation not in documents.MASK_FORMATS:
                    break  # flash attention and the like take no 4-D tensor mask
                self._document_mask = prepared
                try:
                    worst = documents.leak(lambda *row: self.token_losses(*(t.to(device) for t in row)),
                                           self.config.vocab_size)
                except ValueError:
                    if not prepared:
                        raise
                    worst = torch.ones(1, device=device)  # a forward that takes no 4-D mask (one that needs it [b, S])
                comm.all_reduce(worst, self.grid, parallel.AXES, op=torch.distributed.ReduceOp.MAX)
                if worst.item() < 1e-3:  # exactly 0 where documents stay apart
                    return True
            self._document_mask = False
            return False
        finally:
            self.train(was)

    @torch.inference_mode()
    def token_scores(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced (loss, greedy token) [b, S] of this rank's rows, as `token_losses` lays them out."""
        out = self.model.base_model(input_ids=input_ids, use_cache=False)
        return self.head.scores(out[0], labels)

    @torch.inference_mode()
    def token_log_probs(self, input_ids: torch.Tensor, labels: torch.Tensor,
                        with_stats: bool = False) -> tuple[torch.Tensor, ...]:
        """Teacher-forced log p(label) [b, S] of this rank's rows, and with_stats the mean and std of log p over
        the vocabulary (`parallel.vocab_parallel_log_probs`), laid out as `token_losses`."""
        out = self.model.base_model(input_ids=input_ids, use_cache=False)
        return self.head.log_probs(out[0], labels, with_stats)

    def enable_activation_checkpointing(self) -> None:
        """Recompute each transformer block's forward during backward instead of keeping its activations.

        transformers' own per-block checkpointing, non-reentrant: autocast state is replayed and the
        engine's collectives simply run again in the recomputation (the ledger shows each block's forward
        communication twice per step). Results are unchanged; activation memory drops to one block's.
        """
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise ValueError(f"train.activation_checkpointing=true but {type(self.model).__name__} does not support "
                             "gradient checkpointing in transformers: set it to false")
        if self._compiled_blocks:
            blocks.check_compiled_checkpointing(self.grid, next(self.parameters()).device)
        self._blocks_checkpointed = True
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x spelling
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def compile_blocks(self) -> int:
        """torch.compile each transformer block for training (memtrain/hf/blocks.py), once. Parameter names and
        state dicts are unchanged. Returns the number of blocks compiled. Set parallel.tune_matmul before: it
        decides whether a checkpointed block may be compiled too."""
        if self._blocks_checkpointed:
            blocks.check_compiled_checkpointing(self.grid, next(self.parameters()).device)
        if not self._compiled_blocks:
            self._compiled_blocks = blocks.compile_blocks(self.model)
        return self._compiled_blocks

    def num_params(self) -> int:
        """Parameters of the full (unpadded, unsharded) model."""
        return self._num_params

    def param_bytes_per_rank(self) -> int:
        return sum(p.numel() * p.element_size() for p in parallel.unique_parameters(self))

    def state_keys(self) -> list[str]:
        return list(self._keys)

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load full HF tensors into the shards: a dict, a .safetensors file or a directory of them, or an open
        Source (a checkpoint's). Each rank reads only the slices its shards hold."""
        src = state_dict if isinstance(state_dict, Source) else Source(state_dict)
        try:
            avail = set(src.keys())
            found, missing = {}, []
            for key in self._keys:
                hit = next((a for a in self._aliases[key] if a in avail), None)
                if hit is None:
                    missing.append(key)
                else:
                    found[key] = hit
            ignorable = (".inv_freq", ".masked_bias", ".attn.bias", ".attention.bias")
            used = set(found.values()) | self._tied
            unexpected = [k for k in avail - used if not k.endswith(ignorable)]
            if strict and (missing or unexpected):
                raise KeyError(f"state dict does not match {type(self.model).__name__}: missing {missing[:5]}"
                               f"{'...' if len(missing) > 5 else ''}, unexpected {sorted(unexpected)[:5]}: load "
                               "a checkpoint of the same architecture, or pass strict=False")
            for key, hit in found.items():
                slot = self._slots[key]
                if src.shape(hit) != slot.full_shape:
                    raise ValueError(f"{hit}: shape {list(src.shape(hit))} does not match the model's "
                                     f"{list(slot.full_shape)}: the checkpoint belongs to another configuration")
                slot.load(src, hit)
        finally:
            if src is not state_dict:
                src.close()

    def shard_pieces(self, only=None) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        """No communication: this rank's share of the HF state dict as pieces named '<HF name>:<offsets>' (a
        replicated value is written by one rank only), and the full shape of every HF tensor. `only` keeps the
        tensors for which only(tensor) is true. Together, the pieces of all ranks cover every tensor once."""
        pieces, shapes = {}, {}
        for key in self._keys:
            slot = self._slots[key]
            if only is not None and not only(slot.tensor):
                continue
            shapes[key] = list(slot.full_shape)
            for offsets, value in slot.pieces():
                pieces[f"{key}:{','.join(map(str, offsets))}"] = value
        return pieces, shapes

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Collective over the grid: full tensors under HF names and layouts (every rank, or rank 0)."""
        out = {}
        for key in self._keys:
            t = self._slots[key].save()
            if not rank0_only or self.grid.rank == 0:
                out[key] = t
        return out


def _target_device(src: torch.device, device, grid) -> torch.device:
    if device is not None:
        return torch.device(device)
    return src if src.type != "meta" else grid.device


def parallelize(model, grid=None, mode: str = "auto", seed: int = 0, *, device=None,
                weights: str = "auto", loaded_next: bool = False) -> ParallelLM:
    """Shard an HF causal LM over the grid, replacing its layers in place; returns the ParallelLM.

    mode: "sharded" (Llama, GPT-NeoX, GPT-2), "easy" (any model) or "auto" (sharded when possible).
    device: where shards live; default the model's device, or the grid's for a meta model. device="meta"
        builds the sharded shapes without allocating (simulate a grid of any size).
    weights: "seed" draws the engine's seeded init; "model" takes the given model's tensors; "auto"
        (default) loads the checkpoint the model was built from (a from_pretrained model, or the
        directory recorded by build_model(..., device="meta")), else draws the seeded init.
    loaded_next: the caller loads a whole state dict next (the trainer's model.init), so transformers'
        initializer only has to set what none holds (memtrain/hf/materialize.py).
    """
    grid = grid or parallel.current()
    if mode not in PARALLEL_MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(PARALLEL_MODES)}")
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}: use one of {', '.join(WEIGHTS)}")
    family, arch = model.config.model_type, architecture_of(model.config)
    # sharded plans are written for transformers' own code of a family; a model's own code may differ in its blocks
    # or around its head (easy mode's probe looks: architectures.py)
    ours = type(model).__module__.startswith("transformers.models.")
    if mode == "auto":
        mode = "sharded" if arch.sharded and ours else "easy"
    if mode == "sharded" and not arch.sharded:
        raise ValueError(f"sharded mode supports {', '.join(ARCHITECTURES)}, not {family!r}: use mode='easy'")
    if mode == "sharded" and not ours:
        raise ValueError(f"sharded mode follows transformers' own {family} code, not {type(model).__name__}'s: "
                         "use mode='easy'")
    if getattr(model, "_mt_parallelized", False):
        raise ValueError("this model was already parallelized: build a new one")
    first = next(model.parameters())
    target = _target_device(first.device, device, grid)
    source = _weights_source(model, weights)
    keys, tied = hf_keys(model)
    num_params = sum(p.numel() for p in model.parameters())

    b = Builder(model, grid, mode, first.dtype, arch.init_std(model.config))
    arch.plan(model, b, mode)
    model._mt_parallelized = True
    untagged = [n for n, p in model.named_parameters() if not is_tagged(p)]
    if mode == "sharded" and untagged:
        # Gradient sync and clipping read each parameter's ShardSpec; an untagged one would be summed over Y.
        raise RuntimeError(f"the {family} plan left parameters without a ShardSpec: {untagged[:5]}")
    if target.type != "meta":
        materialize(model, b, seed, source is None, target, loaded_next or source is not None)
    keep_leftovers(model, b, keys, seed, source is None, target)
    plm = ParallelLM(model, grid, mode, arch, b, keys, tied, num_params)
    if source is not None and target.type != "meta":
        plm.load_hf_state_dict(source)
    return plm


def _weights_source(model, weights: str):
    """What fills the shards after parallelize: a state dict, a checkpoint directory, or None (the seed)."""
    on_meta = next(model.parameters()).device.type == "meta"
    if weights == "model" or (weights == "auto" and not on_meta and model.config._name_or_path):
        if on_meta:
            raise ValueError("weights='model' needs a model with real tensors, not one on the meta device")
        return dict(model.state_dict())  # the tensors outlive the modules parallelize replaces
    if weights == "auto":
        return getattr(model, "memtrain_weights", None)
    return None


def hf_keys(model) -> tuple[list[str], list[str]]:
    """HF names in state-dict order, and the tied duplicates (a tied parameter keeps its first name, as
    save_pretrained writes it)."""
    first, tied = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.append(name)
        first.add(id(p))
    return [k for k in model.state_dict() if k not in tied], tied


def export_hf(plm: ParallelLM, hf_config=None, out_dir: str | os.PathLike = "model") -> Path | None:
    """Collective: write a from_pretrained-loadable directory (model.safetensors + config.json).

    Rank 0 writes into a temporary sibling directory and renames it into place, so a crash never leaves
    a half-written model at `out_dir`. Returns the path on rank 0, None elsewhere.
    """
    from safetensors.torch import save_file

    state = plm.full_state_dict(rank0_only=True)
    out = Path(out_dir)
    result = None
    if plm.grid.rank == 0:
        config = copy.deepcopy(hf_config or plm.config)
        config.architectures = [type(plm.model).__name__]
        with atomic_dir(out) as tmp:
            save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            config.save_pretrained(tmp)
        result = out
    flag = torch.zeros(1, device=next(plm.parameters()).device)
    comm.all_reduce(flag, plm.grid, parallel.AXES)  # barrier: the directory exists when anyone returns
    return result


__all__ = ["ParallelLM", "export_hf", "parallelize"]
