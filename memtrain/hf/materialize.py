"""Storage and initial values for a parallelized model: the engine's tensors drawn from the seed (slots.py), every
other tensor by transformers' own initializer, and the tensors no plan claimed kept whole and replicated.

A model built on the meta device has no values at all: a tensor that no initializer writes would hold whatever the
allocator left there, so each one starts as NaN (an integer type's least value) and is refused if it stays so.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

try:  # transformers >= 5: under this guard torch.nn.init's functions skip marked tensors too, as its own do
    from transformers.initialization import guard_torch_init_functions
except ImportError:
    guard_torch_init_functions = contextlib.nullcontext

import parallel
from memtrain.hf.slots import Builder
from memtrain.models import seeded_rng


def materialize(model, b: Builder, seed: int, seeded: bool, target, loaded_next: bool) -> None:
    """Engine tensors first (drawn from the seed, or left empty when a checkpoint fills them next), then
    whatever HF tensor is still on meta (replicated norms, rotary buffers) through HF's own initializer: its
    module's, then, for what that leaves unset, its ancestors' (Falcon-H1's model sets each mixer's mup_vector).
    loaded_next: every tensor of the state dict is loaded next, so only the others (buffers) must be set here."""
    for s in b.slots:
        s.materialize(seed, seeded, target)
    allocated = []
    for m in model.modules():
        was_meta = {name for name, t in _own_tensors(m) if t.device.type == "meta"}
        if was_meta:
            m.to_empty(device=target, recurse=False)
            for name, t in _own_tensors(m):
                if name in was_meta:
                    _mark_unset(t)
                    allocated.append((m, name))
    owners = {id(m) for m, _ in allocated}
    loaded = {id(t) for t in model.state_dict(keep_vars=True).values()} if loaded_next else set()
    # transformers' order (children first: a mixer's init of its time-step layer wins over the layer's own), and
    # the engine's tensors protected from an init that reaches into a child layer the engine replaced
    with seeded_rng(seed, target), torch.no_grad(), \
            _others_protected(model, {id(getattr(m, name)) for m, name in allocated}, loaded):
        for m in _children_first(model):
            if id(m) in owners:
                model._init_weights(m)
    model.to(target)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"tensors left on the meta device after parallelize: {left[:5]}")
    unset = [(m, name) for m, name in allocated if _unset(getattr(m, name)) and id(getattr(m, name)) not in loaded]
    # another stream than the first pass's, so a tensor drawn here does not repeat one drawn there
    _init_from_ancestors(model, unset, seed + 1, target, loaded)


@contextlib.contextmanager
def _others_protected(model, writable: set[int], loaded: set[int]):
    """Every tensor of the model but those in `writable` (ids) marked as transformers marks loaded ones, so that its
    init functions (torch.nn.init's too, under its guard) skip it; yields a function that protects one more. Only
    the marks added here are removed. An initializer that wrote a marked tensor anyway is refused, unless the
    tensor is in `loaded` (a checkpoint overwrites it next); a write through `.data` escapes the version counter
    this reads, and is not caught."""
    marked = []

    def protect(t: torch.Tensor) -> None:
        t._is_hf_initialized = True
        marked.append((t, t._version))

    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in writable and not getattr(t, "_is_hf_initialized", False):
            protect(t)
    try:
        with guard_torch_init_functions():
            yield protect
    finally:
        for t, _ in marked:
            del t._is_hf_initialized
    written = {id(t) for t, version in marked if t._version != version and id(t) not in loaded}
    if written:
        tensors = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if id(t) in written]
        raise ValueError(f"{type(model).__name__}: transformers' initializer rewrites {', '.join(tensors[:3])} "
                         "when it sets the tensors memtrain leaves to it: start from the model's weights "
                         "(model.init, or a model directory with weights)")


def _children_first(m: nn.Module, seen: set[int] | None = None):
    """Every module once, each after its children (the order transformers initializes a model in)."""
    seen = set() if seen is None else seen
    for child in m.children():
        if id(child) not in seen:
            yield from _children_first(child, seen)
    if id(m) not in seen:
        seen.add(id(m))
        yield m


def _own_tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))


def _mark_unset(t: torch.Tensor) -> None:
    """Fill a freshly allocated tensor with what no initializer writes (NaN; an integer type's least value), so
    one left unset is found instead of trained on as whatever the allocator held. A bool tensor has no such
    value and is not checked."""
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)


def _unset(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(t.isnan().any())
    return bool((t == torch.iinfo(t.dtype).min).any())


def _init_from_ancestors(model, unset: list[tuple[nn.Module, str]], seed: int, target: torch.device,
                         loaded: set[int]) -> None:
    """Run HF's initializer on the ancestors of modules whose own left a tensor unset, nearest first, with every
    tensor already set marked as transformers marks loaded ones, so that its init functions (torch.nn.init's too,
    under its guard) skip it; refuse what stays unset, and an initializer that wrote a marked tensor anyway."""
    if not unset:
        return
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    ancestors = []
    for m, _ in unset:
        while id(m) in parents:
            m = parents[id(m)]
            if all(a is not m for a in ancestors):
                ancestors.append(m)
    writable = {id(getattr(m, name)) for m, name in unset}
    with seeded_rng(seed, target), torch.no_grad(), _others_protected(model, writable, loaded) as protect:
        for a in ancestors:
            model._init_weights(a)
            for m, name in unset:  # the nearest ancestor's values are kept
                t = getattr(m, name)
                if not _unset(t) and not getattr(t, "_is_hf_initialized", False):
                    protect(t)
    names = {id(m): prefix for prefix, m in model.named_modules()}
    still = [(f"{names[id(m)]}.{name}", id(getattr(m, name)))
             for m, name in unset if _unset(getattr(m, name))]
    if still:
        persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
        fix = ("start from the model's weights (model.init, or a model directory with weights)"
               if all(i in persistent for _, i in still) else
               "a buffer no checkpoint holds, so memtrain cannot build this model: train it with transformers alone")
        raise ValueError(f"{type(model).__name__}: transformers' initializer leaves "
                         f"{', '.join(n for n, _ in still[:3])} unset: {fix}")


def keep_leftovers(model, b: Builder, keys: list[str], seed: int, seeded: bool, target) -> None:
    """HF tensors no plan claimed stay whole and replicated. Leftover embedding tables (GPT-2's wpe in
    easy mode, OPT's positions) take the seeded init like every matrix, so both modes start equal."""
    std_of = b.std_of
    claimed = {s.key for s in b.slots}
    for key in keys:
        if key in claimed:
            continue
        owner, _, attr = key.rpartition(".")
        mod = model.get_submodule(owner)
        if isinstance(mod, (parallel.Linear, parallel.Embedding, parallel.LMHead)):
            raise RuntimeError(f"{key}: its module was replaced but the plan did not map it")
        init = "normal" if isinstance(mod, nn.Embedding) and attr == "weight" else None
        b.part(key, mod, attr, full_shape=getattr(mod, attr).shape, init=init, std=std_of(key))
        if target.type != "meta" and init and seeded:
            b.slots[-1].materialize(seed, True, target)
