"""The dry run's fake tensors (memtrain/plan/fake.py): what the step reads from them, and how a model becomes them.

- Reads: a scalar read gives 1 (True for a bool, 1.0 for a float) and a boolean-mask index selects every
  element, whatever the tensor would hold.
- A meta model becomes fake CPU tensors in place: shapes and dtypes kept, a tied parameter stays one parameter,
  the engine's ShardSpec tag and requires_grad are kept, nothing is allocated for real.
SavedTensors (what autograd saves) is measured by every dry run of test_dryrun.py against cost.activation_bytes.
"""

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memtrain.plan.fake import DryMode, to_fake
from parallel.sharding import spec_of, tag


def test_reads_give_fixed_values():
    with DryMode():
        t = torch.zeros(4)
        assert t.sum().item() == 1.0 and isinstance(t.sum().item(), float)
        assert torch.zeros(2, dtype=torch.long).max().item() == 1
        assert bool((t > 5).all()) is True  # a Python `if` on a tensor holds
        mask = torch.zeros(2, 3, dtype=torch.bool)
        assert torch.zeros(2, 3)[mask].shape == (6,)


def test_a_meta_model_becomes_fake_in_place():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.LayerNorm(4))
    model[1].weight = model[0].weight  # tied, as an LM head to its embedding
    tag(model[2].weight, ("x",), ("z", "data"))
    model[2].bias.requires_grad_(False)
    model.register_buffer("steps", torch.zeros(3, dtype=torch.long, device="meta"))
    to_fake(model, DryMode())
    params = list(model.parameters())
    assert len(params) == 3 and model[1].weight is model[0].weight
    assert all(isinstance(t, FakeTensor) and t.device.type == "cpu" for t in [*params, *model.buffers()])
    assert [tuple(p.shape) for p in params] == [(10, 4), (4,), (4,)] and model.steps.dtype == torch.long
    assert spec_of(model[2].weight).reduce_axes == ("z", "data") and not model[2].bias.requires_grad
