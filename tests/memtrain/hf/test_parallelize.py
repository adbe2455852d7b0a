"""Parallelized HF models on 8 gloo ranks vs the unmodified transformers model on one process.

Each tiny model (Llama with GQA, GPT-NeoX/Pythia, GPT-2 with tied embeddings and a vocabulary of 99
that needs padding on Y=2 and Y=8) trains 3 AdamW steps on every 8-rank grid, in sharded and easy mode,
with the global-token-normalized loss (sum of token losses / global supervised count, sync_gradients,
step). The reference is the plain HF model trained with torch AdamW on the whole batch. OPT (no plan:
easy mode only) and runs under parallel.overlap cover the generic path and the overlap switches.

Tolerances (fp32):
- initial weights: exact. The seeded init and a loaded state dict are copies of the same numbers.
- loss at every step, gradients of step 1 and their global norm (parallel.grad_norm, as clipping sees
  it): 1e-5 relative (gradients: per tensor, relative to its largest entry). The sharded matmuls sum
  the same products in another order (per-shard partial sums, then a reduction over the group):
  ~1e-7 relative per matmul, measured <= 1e-6 after backward. A wrong shard, a missed or doubled
  reduction gives O(1).
- parameters after 3 steps: 2e-2 * lr absolute. Adam is scale-free, so the gradient check above is
  what catches scale errors; here what matters is that the optimizer sees the same tensors. Adam's
  update lr * m / (sqrt(v) + eps) changes by at most lr * delta / eps for a gradient error delta: with
  delta ~ 1e-6 * max|g| ~ 1e-8 and eps = 1e-5, up to ~1e-5 per step on entries whose gradient is near
  eps (measured max 1.4e-5 after 3 steps, ~2e-5 after 5). A wrongly synchronized or stepped tensor is off by
  ~lr = 1e-2.
"""

import copy
import multiprocessing as mp
import os
import time
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import parallel
from memtrain.hf import export_hf, parallelize
from memtrain.models import build_model
from parallel import padded_vocab
from parallel.forked import run_ranks
from tests._helpers import GRIDS, MODES, grid_id, once_per_session
from tests.memtrain._models import tiny

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("llama", "neox", "gpt2")
# (grid, family, mode, options): OPT through the generic easy path; runs under overlap (OAR + ORS + OAG)
# and with activation checkpointing (each block's forward, collectives included, recomputed in backward).
EXTRA = [((2, 2, 2, 1), "opt", "easy", ""), ((1, 2, 2, 2), "opt", "easy", ""),
         ((1, 2, 2, 2), "llama", "sharded", "overlap"), ((2, 2, 1, 2), "llama", "sharded", "overlap"),
         ((1, 2, 2, 2), "gpt2", "easy", "overlap"), ((1, 2, 2, 2), "llama", "sharded", "recompute"),
         ((2, 2, 1, 2), "neox", "sharded", "overlap+recompute"), ((2, 2, 2, 1), "gpt2", "easy", "recompute")]
B, S, STEPS, LR, WD, EPS, SEED = 8, 12, 3, 1e-2, 0.01, 1e-5, 3
LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-5, 1e-5, 2e-2 * LR


def batch(step, vocab):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.2] = -100
    return ids, labels


def hf_train(model):
    """The reference: unmodified HF model, torch AdamW, the whole batch on one process."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step, model.config.vocab_size)
        logits = model(ids).logits
        tl = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = tl.sum() / (labels != -100).sum()
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            norm = float(torch.cat([g.reshape(-1) for g in grads.values()]).norm())
        opt.step()
        losses.append(float(loss.detach()))
    return losses, (grads, norm)


def state(model):
    """HF state dict without the tied duplicate (as save_pretrained and full_state_dict write it)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if k != "lm_head.weight" or not model.config.tie_word_embeddings}


def full_grads(plm):
    """Gradients in full HF layout: gather them as if they were the weights (as checkpoint.py does)."""
    params = list({id(p): p for p in plm.parameters()}.values())
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad
        return plm.full_state_dict()
    finally:
        for p, d in zip(params, saved):
            p.data = d


def plm_train(plm, grid, overlap=False):
    opt = torch.optim.AdamW(plm.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    rows = plm.local_rows(B)
    losses = []
    first = next(m for m in plm.modules() if isinstance(m, parallel.Linear))
    first.calls = 0
    first.register_forward_hook(lambda m, i, o: setattr(m, "calls", m.calls + 1))
    for step in range(STEPS):
        ids, labels = batch(step, plm.config.vocab_size)
        n = (labels != -100).sum()
        opt.zero_grad()
        with parallel.overlap(plm) if overlap else nullcontext():
            total = plm.token_losses(ids[rows], labels[rows]).sum()
            (total / n).backward()
        parallel.sync_gradients(plm, grid)
        if step == 0:
            grads = full_grads(plm)
            norm = float(parallel.grad_norm(plm, grid))  # what clip_grad_norm_ sees
        opt.step()
        total = total.detach().clone()
        parallel.comm.all_reduce(total, grid, plm.row_axes)
        losses.append(float(total / n))
    return losses, (grads, norm), first.calls / STEPS


def _max_abs(sd, ref):
    assert sd.keys() == ref.keys(), sorted(sd.keys() ^ ref.keys())
    return max(float((sd[k] - ref[k]).abs().max()) for k in ref)


def _rel_each(sd, ref):
    """Largest per-tensor error relative to the tensor's largest reference entry. A gradient that is zero
    in exact arithmetic (a key bias: softmax ignores it) is pure rounding noise, so each tensor's scale
    is floored at 1e-3 of the largest gradient of the model."""
    assert sd.keys() == ref.keys(), sorted(sd.keys() ^ ref.keys())
    floor = 1e-3 * max(float(t.abs().max()) for t in ref.values())
    return max(float((sd[k] - ref[k]).abs().max()) / max(float(ref[k].abs().max()), floor) for k in ref)


def _case(grid, fam, mode, ref, options=""):
    init, losses, (grads, norm), final = ref
    if mode == "sharded":  # the engine's seeded init, shard by shard
        plm = parallelize(tiny(fam, "meta"), grid, mode, seed=SEED, device="cpu")
    else:  # another seed, then the reference weights loaded over it
        plm = parallelize(tiny(fam, "meta"), grid, mode, seed=SEED + 1, device="cpu")
        plm.load_hf_state_dict(init)
    init_err = _max_abs(plm.full_state_dict(), init)
    if "recompute" in options:
        plm.enable_activation_checkpointing()
    got, (got_grads, got_norm), forwards = plm_train(plm, grid, "overlap" in options)
    return {"init": init_err, "forwards_per_step": forwards, "loss": max(abs(a - b) / b for a, b in zip(got, losses)),
            "grad": _rel_each(got_grads, grads), "grad_norm": abs(got_norm / norm - 1),
            "params": _max_abs(plm.full_state_dict(), final),
            "vocab": plm.head.vocab}


def _worker(rank, world, refs, root):
    out = {}
    grids = {}
    for degrees in GRIDS:
        grid = grids[degrees] = parallel.Grid(*degrees, rank=rank)
        grid.build_groups()
        for fam in FAMILIES:
            for mode in MODES:
                out[(degrees, fam, mode, "")] = _case(grid, fam, mode, refs[fam])
    for degrees, fam, mode, options in EXTRA:
        out[(degrees, fam, mode, options)] = _case(grids[degrees], fam, mode, refs[fam], options)
    # HF round trip on (1, 2, 2, 2): an HF checkpoint directory -> meta model -> parallelize reads the
    # safetensors slice by slice into the shards -> full_state_dict -> export_hf (loaded by the parent).
    for fam in FAMILIES:
        plm = parallelize(build_model(os.path.join(root, f"hf_{fam}"), device="meta"), grids[(1, 2, 2, 2)],
                          "sharded", device="cpu")
        out[("roundtrip", fam)] = _max_abs(plm.full_state_dict(), refs[fam + "_hf"])
        export_hf(plm, None, os.path.join(root, f"export_{fam}"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    """(worst errors per case, HF-initialized originals, the directory of their checkpoints and exports): computed
    once per session, the files read only."""

    def compute():
        root = str(tmp_path_factory.mktemp("export"))
        refs, originals = {}, {}
        for fam in FAMILIES + ("opt",):
            # Seeded init on one process (grid 1x1x1x1: no process group needed) = the initial weights.
            init = parallelize(tiny(fam, "meta"), parallel.Grid(1, 1, 1, 1), seed=SEED, device="cpu").full_state_dict()
            model = tiny(fam)
            model.load_state_dict(init, strict=not model.config.tie_word_embeddings)
            losses, grads = hf_train(model)
            refs[fam] = (init, losses, grads, state(model))
            if fam != "opt":
                originals[fam] = tiny(fam)  # HF's own init, saved as a checkpoint directory
                originals[fam].save_pretrained(os.path.join(root, f"hf_{fam}"))
                refs[fam + "_hf"] = state(originals[fam])
        t = time.perf_counter()
        per_rank = run_ranks(8, _worker, refs, root)
        print(f"8 ranks: {time.perf_counter() - t:.1f} s")
        merged = {}
        for r in per_rank:
            for case, v in r.items():
                if isinstance(v, dict):
                    merged[case] = {k: max(merged.get(case, {}).get(k, x), x) for k, x in v.items()}
                else:
                    merged[case] = max(merged.get(case, v), v)
        worst = {k: max(v[k] for v in merged.values() if isinstance(v, dict)) for k in ("loss", "grad", "grad_norm",
                                                                                        "params")}
        print("worst over all cases:", {k: f"{v:.1e}" for k, v in worst.items()})
        return merged, originals, root

    return once_per_session(request, compute)


def _check(r):
    assert r["init"] == 0.0, r
    assert r["loss"] < LOSS_TOL, r
    assert r["grad"] < GRAD_TOL and r["grad_norm"] < GRAD_TOL, r
    assert r["params"] < PARAM_TOL, r


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_training_matches_hf(results, degrees, fam, mode):
    _check(results[0][(degrees, fam, mode, "")])


@pytest.mark.parametrize("case", EXTRA, ids=lambda c: "d{}x{}y{}z{}-{}-{}-{}".format(*c[0], *c[1:3], c[3] or "plain"))
def test_generic_overlap_and_recompute_match_hf(results, case):
    r = results[0][case]
    _check(r)
    # Recomputation really happened: the first sharded Linear ran forward twice per micro-batch.
    assert r["forwards_per_step"] == (2 if "recompute" in case[3] else 1), r


@pytest.mark.parametrize("degrees", GRIDS, ids=grid_id)
def test_vocab_padding(results, degrees):
    """GPT-2's vocabulary of 99 is padded to a multiple of Y on Y=2 and Y=8 (and training matched)."""
    for mode in MODES:
        v = results[0][(degrees, "gpt2", mode, "")]["vocab"]
        assert v == padded_vocab(99, 32, parallel.Grid(*degrees)) and v % degrees[2] == 0
        assert (v > 99) == (degrees[2] > 1), v


@pytest.mark.parametrize("fam", FAMILIES)
def test_hf_round_trip(results, fam):
    from transformers import AutoModelForCausalLM

    merged, originals, root = results
    assert merged[("roundtrip", fam)] == 0.0
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(root, f"export_{fam}"))
    ids, _ = batch(0, originals[fam].config.vocab_size)
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, originals[fam](ids).logits)


# --------------------------------------------------------------------------------------------------
# Scale by simulation: one rank of a 4096-rank grid, fake process group, nothing allocated.


def _simulate(q, rank):
    try:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4096)
        grid = parallel.Grid(8, 8, 8, 8, rank=rank)
        grid.build_groups()
        t = time.perf_counter()
        model = build_model("llama-3.1-405b", device="meta", dtype=torch.bfloat16)
        plm = parallelize(model, grid, "sharded", device="meta")
        q.put(("ok", plm.param_bytes_per_rank(), plm.num_params(), time.perf_counter() - t,
               all(p.device.type == "meta" for p in plm.parameters()),
               tuple(plm.model.model.layers[0].mlp.down_proj.weight.shape)))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        q.put(("error", repr(e)))


def test_llama_405b_on_4096_ranks_by_simulation():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_simulate, args=(q, 2989))
    proc.start()
    try:
        res = q.get(timeout=240)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert res[0] == "ok", res
    _, nbytes, n, seconds, all_meta, down = res
    assert n == 405_853_388_800 and all_meta and seconds < 120
    # Matrices split 512 ways (x*y*z); the 2*126+1 norms of 16384 split over X only.
    norms = (2 * 126 + 1) * 16384
    assert nbytes == 2 * ((n - norms) // 512 + norms // 8)
    assert down == (53248 * 16384 // 512,)
    print(f"llama-3.1-405b on 4096 ranks: {nbytes / 2**30:.2f} GiB of bf16 parameters per rank ({seconds:.1f} s)")


# --------------------------------------------------------------------------------------------------
# Single process: grid 1x1x1x1 needs no process group; other grids only validate (meta, no collectives).


def test_weights_from_pretrained_model_and_single_process(tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # a checkpoint: weights="auto" keeps its weights
    ref = state(loaded)
    plm = parallelize(loaded, parallel.Grid(1, 1, 1, 1))
    assert plm.mode == "sharded" and _max_abs(plm.full_state_dict(), ref) == 0.0
    ids, labels = batch(0, 128)
    want = F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten(), reduction="none").view(B, S)
    assert torch.allclose(plm.token_losses(ids, labels), want, atol=1e-6)
    other = parallelize(tiny("llama"), parallel.Grid(1, 1, 1, 1), "easy", weights="model")
    assert _max_abs(other.full_state_dict(), state(model)) == 0.0  # same seed, same HF init
    seeded = parallelize(tiny("llama"), parallel.Grid(1, 1, 1, 1), seed=SEED)
    assert _max_abs(seeded.full_state_dict(), ref) > 0.0  # the engine's init, not HF's


def _meta_plm(fam, degrees, rank=0, mode="sharded", **kw):
    return parallelize(tiny(fam, "meta", **kw), parallel.Grid(*degrees, rank=rank), mode, device="meta")


@pytest.mark.parametrize("kw, degrees, message", [
    ({}, (1, 1, 3, 1), "num_attention_heads=16 is not divisible by parallel.y=3"),
    ({"num_key_value_heads": 2}, (1, 1, 4, 1), "num_key_value_heads=2 is not divisible by parallel.y=4"),
    ({}, (1, 3, 1, 1), "hidden_size=64 is not divisible by parallel.x=3"),
    ({"intermediate_size": 100}, (1, 1, 8, 1), "intermediate_size=100 is not divisible by parallel.y=8"),
])
def test_indivisible_sizes_name_value_and_fix(kw, degrees, message):
    with pytest.raises(ValueError, match=message) as e:
        _meta_plm("llama", degrees, **kw)
    assert "choose parallel." in str(e.value)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        parallelize(tiny("llama", "meta"), parallel.Grid(1, 1, 1, 1), "fast")
    with pytest.raises(ValueError, match="use mode='easy'"):
        parallelize(tiny("opt", "meta"), parallel.Grid(1, 1, 1, 1), "sharded")
    assert _meta_plm("opt", (1, 1, 1, 1), mode="auto").mode == "easy"
    plm = _meta_plm("llama", (8, 1, 1, 1), rank=3)
    assert plm.local_rows(16) == slice(6, 8) and plm.row_axes == ("z", "data")
    with pytest.raises(ValueError, match="use a multiple of 8"):
        plm.local_rows(12)
    easy = _meta_plm("llama", (2, 2, 1, 1), rank=3, mode="easy")
    assert easy.local_rows(8) == slice(6, 8) and easy.row_axes == parallel.AXES
    model = tiny("llama", "meta")
    parallelize(model, parallel.Grid(1, 1, 1, 1), device="meta")
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize(model, parallel.Grid(1, 1, 1, 1))


AROUND = {  # what each model does around the embedding and LM head the engine replaces, and its config
    "gemma2": ("a lookup scaled by a float32 buffer, soft-capped logits",
               dict(vocab_size=63, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=8, final_logit_softcapping=3.0)),
    "granite": ("logits divided by logits_scaling", dict(vocab_size=63, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, logits_scaling=8.0)),
    "hyperclovax": ("logits times logits_scaling (Granite's field, the other way)", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, logits_scaling=4.0)),
    "falcon_h1": ("logits times lm_head_multiplier", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, lm_head_multiplier=4.0, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
        mamba_d_state=8)),
    "cohere": ("logits times logit_scale", dict(vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, logit_scale=0.5)),
    "minicpm3": ("a scaled lookup, hidden states divided before the head", dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=4,
        v_head_dim=8, dim_model_base=8)),
    "xglm": ("a lookup scaled by a Python float", dict(vocab_size=64, d_model=32, num_layers=1, attention_heads=4,
             ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
    "mpt": ("a logit_scale in its config that its forward never reads", dict(vocab_size=64, d_model=32, n_layers=1,
            n_heads=4, expansion_ratio=2, logit_scale=4.0)),
    "recurrent_gemma": ("logits soft-capped by logits_soft_cap, always (30 by default)", dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, lru_width=32,
        block_types=["recurrent", "attention"], head_dim=8)),
}


def _around(family, grid=None):
    """(plain transformers model, its easy-mode ParallelLM with the same weights, a batch)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **AROUND[family][1]))
    plm = parallelize(copy.deepcopy(ref), grid or parallel.Grid(1, 1, 1, 1), "easy", weights="model")
    ids, labels = batch(0, ref.config.vocab_size)
    return ref, plm, ids, labels


@pytest.mark.parametrize("family", AROUND)
def test_what_a_model_does_around_the_replaced_layers_is_carried(family):
    """The engine replaces the embedding and LM head and reads the base model's hidden states, so a scaled lookup
    (Gemma, XGLM, MiniCPM3) or transformed logits (Granite, HyperCLOVA X, Falcon-H1, Cohere, Gemma 2 soft-capping)
    would be dropped: measured, Granite's loss off by 0.25 nats. The engine's layers carry them (RecurrentGemma's
    soft-cap, in no field the engine knew, was dropped silently: 2e-5 relative on a fresh model's small logits):
    per-token losses and every gradient equal the plain model's within 1e-5 relative (fp32: the engine's loss sums
    in another order, ~1e-7; MiniCPM3 divides the logits where transformers divides the hidden states, the same up
    to rounding)."""
    assert_trains_as_plain(*_around(family)[:2])


def assert_trains_as_plain(ref, plm):
    """On one batch, per-token losses within LOSS_TOL relative and every gradient within GRAD_TOL (`_rel_each`) of
    the plain transformers model `ref` whose weights `plm` holds."""
    ids, labels = batch(0, ref.config.vocab_size)
    want = F.cross_entropy(ref(ids).logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(B, S)
    got = plm.token_losses(ids, labels)
    assert float((got - want).detach().abs().max() / want.detach().abs().max()) < LOSS_TOL
    want.sum().backward()
    got.sum().backward()
    assert _rel_each(full_grads(plm), {k: p.grad for k, p in ref.named_parameters()}) < GRAD_TOL


def _around_on_two(rank, world):
    grid = parallel.Grid(1, 1, 2, 1, rank=rank)  # the vocabulary (63: padded to 64) split over Y
    grid.build_groups()
    out = {}
    for family in ("gemma2", "granite"):
        ref, plm, ids, labels = _around(family, grid)
        rows = plm.local_rows(B)
        with torch.no_grad():
            want = F.cross_entropy(ref(ids).logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
            got = plm.token_losses(ids[rows], labels[rows])
        out[family] = float((got - want.view(B, S)[rows]).abs().max() / want.abs().max())
    return out


def test_logit_transforms_on_a_split_vocabulary():
    """Soft-capping and scaling act on each vocabulary shard's logits alone, and before the padded rows are masked
    (a soft-cap would lift their -1e30 to -cap)."""
    for res in run_ranks(2, _around_on_two):
        assert all(err < LOSS_TOL for err in res.values()), res


class OwnGranite(__import__("transformers").GraniteForCausalLM):
    """A model's own code (as trust_remote_code loads it): what it does with logits_scaling is unknown."""


class OwnCappedLlama(__import__("transformers").LlamaForCausalLM):
    """A model's own code that soft-caps its logits in its forward, no config field saying so."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = torch.tanh(out.logits / 30.0) * 30.0
        return out


class OwnMaskedLlama(__import__("transformers").LlamaForCausalLM):
    """A model's own code that rules tokens out by setting their logits."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits[..., :4] = -1e4
        return out


class OwnNarrowedLlama(__import__("transformers").LlamaForCausalLM):
    """A model's own code that keeps the first logits only (a vocabulary padded in its checkpoint)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits[..., :100]
        return out


class OwnScaledHiddenLlama(__import__("transformers").LlamaForCausalLM):
    """A model's own code that scales the hidden states before its LM head."""

    def forward(self, input_ids=None, **kwargs):
        return self.lm_head(self.model(input_ids=input_ids, **kwargs)[0] / 8.0)


class OwnScaledWordEmbedding(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2


def test_what_the_engine_cannot_carry_is_refused():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("granite", **AROUND["granite"][1])
    with torch.device("meta"):
        model = OwnGranite(cfg)
    with pytest.raises(ValueError, match="config.logits_scaling=8.0 transforms the logits after the LM head in a way"):
        parallelize(model, parallel.Grid(1, 1, 1, 1), "easy", device="meta")
    # found by the meta forward (memtrain/hf/probe.py): RecurrentGemma's soft-cap went unseen
    own_code = ((OwnCappedLlama, "div, tanh, mul"), (OwnMaskedLlama, "__setitem__"), (OwnScaledHiddenLlama, "div"),
                (OwnNarrowedLlama, "a slice of the last dimension"))
    for own, ops in own_code:
        with torch.device("meta"):
            model = own(tiny("llama", "meta").config)
        with pytest.raises(ValueError, match=f"its forward applies {ops} between its hidden states and its logits"):
            parallelize(model, parallel.Grid(1, 1, 1, 1), "easy", device="meta")
        with pytest.raises(ValueError, match=f"sharded mode follows transformers' own llama code, not {own.__name__}"):
            parallelize(model, parallel.Grid(1, 1, 1, 1), "sharded", device="meta")
    model = tiny("llama", "meta")
    model.model.embed_tokens = OwnScaledWordEmbedding(128, 64)
    with pytest.raises(ValueError, match="its input embedding OwnScaledWordEmbedding changes the lookup") as e:
        parallelize(model, parallel.Grid(1, 1, 1, 1), "easy", device="meta")
    assert "score it on one process" in str(e.value)


def test_bad_state_dicts():
    plm = parallelize(tiny("llama", "meta"), parallel.Grid(1, 1, 1, 1), device="cpu")
    sd = plm.full_state_dict()
    with pytest.raises(KeyError, match="missing .'model.norm.weight'"):
        plm.load_hf_state_dict({k: v for k, v in sd.items() if k != "model.norm.weight"})
    with pytest.raises(KeyError, match="unexpected .'extra'"):
        plm.load_hf_state_dict(dict(sd, extra=torch.zeros(1)))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: shape \[64, 64\]"):
        plm.load_hf_state_dict(dict(sd, **{"model.embed_tokens.weight": torch.zeros(64, 64)}))
    plm.load_hf_state_dict({k: v for k, v in sd.items() if k != "model.norm.weight"}, strict=False)


def test_dropout_is_refused_in_sharded_training_only():
    ids, labels = batch(0, 99)
    plm = parallelize(tiny("gpt2", attn_pdrop=0.1), parallel.Grid(1, 1, 1, 1), "sharded")
    plm.train()
    with pytest.raises(ValueError, match="dropout"):
        plm.token_losses(ids, labels)
    plm.eval()
    plm.token_losses(ids, labels)
    easy = parallelize(tiny("gpt2", attn_pdrop=0.1), parallel.Grid(1, 1, 1, 1), "easy")
    easy.train()
    easy.token_losses(ids, labels)
