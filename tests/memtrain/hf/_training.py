"""Training a parallelized HF model and its plain transformers twin side by side, and comparing them: the
batches, the two training loops and the error measures of test_parallelize.py, test_around.py and
test_architectures.py.

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

from contextlib import nullcontext

import torch
import torch.nn.functional as F

import parallel

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


def max_abs(sd, ref):
    assert sd.keys() == ref.keys(), sorted(sd.keys() ^ ref.keys())
    return max(float((sd[k] - ref[k]).abs().max()) for k in ref)


def rel_each(sd, ref):
    """Largest per-tensor error relative to the tensor's largest reference entry. A gradient that is zero
    in exact arithmetic (a key bias: softmax ignores it) is pure rounding noise, so each tensor's scale
    is floored at 1e-3 of the largest gradient of the model."""
    assert sd.keys() == ref.keys(), sorted(sd.keys() ^ ref.keys())
    floor = 1e-3 * max(float(t.abs().max()) for t in ref.values())
    return max(float((sd[k] - ref[k]).abs().max()) / max(float(ref[k].abs().max()), floor) for k in ref)



def assert_trains_as_plain(ref, plm):
    """On one batch, per-token losses within LOSS_TOL relative and every gradient within GRAD_TOL (`rel_each`) of
    the plain transformers model `ref` whose weights `plm` holds."""
    ids, labels = batch(0, ref.config.vocab_size)
    want = F.cross_entropy(ref(ids).logits.flatten(0, 1).float(), labels.flatten(), reduction="none").view(B, S)
    got = plm.token_losses(ids, labels)
    assert float((got - want).detach().abs().max() / want.detach().abs().max()) < LOSS_TOL
    want.sum().backward()
    got.sum().backward()
    assert rel_each(full_grads(plm), {k: p.grad for k, p in ref.named_parameters()}) < GRAD_TOL
