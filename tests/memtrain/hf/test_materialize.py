"""memtrain/hf/materialize.py: parallelize from the seed on a model built on the meta device. The tensors no
engine layer holds (norms, buffers) get transformers' own initial values, and none is left as whatever the
allocator held.

Reference: the plain transformers model built on a CPU, initialized by transformers itself.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import parallel
from memtrain.hf import parallelize

# Falcon-H1: its model module, not the mixer holding it, sets each mixer's mup_vector buffer (a parent's init)
FALCON_H1 = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8)


def _seeded():
    config = AutoConfig.for_model("falcon_h1", **FALCON_H1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, parallelize(model, parallel.Grid(1, 1, 1, 1), "easy", seed=0, device="cpu")


def test_a_buffer_set_by_a_parent_modules_init_has_transformers_values():
    """Before, the mup_vector buffers held the allocator's leftovers (-8e-28, 4.6e-41, ...) and the loss was NaN.
    Buffers equal the plain model's bitwise (the same init code), and the losses equal the plain model's given the
    engine's weights within 1e-5 relative (the engine's loss sums in another order, ~1e-7)."""
    config, plm = _seeded()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config)
    want = dict(ref.named_buffers())
    got = {name.removeprefix("model."): b for name, b in plm.named_buffers()}
    assert set(got) == set(want) and any("mup_vector" in name for name in got)
    assert all(torch.equal(got[name], want[name]) for name in want)
    ref.load_state_dict(plm.full_state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ref(ids[:, :-1]).logits
        expected = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(2, -1)
        losses = plm.token_losses(ids[:, :-1], ids[:, 1:])
    assert torch.isfinite(losses).all()
    assert float((losses - expected).abs().max() / expected.abs().max()) < 1e-5


def test_a_tensor_no_initializer_sets_is_refused(monkeypatch):
    """An initializer that sets nothing for a tensor (here Falcon-H1's without its mup_vector line) leaves it
    unset: refused with the way out, not trained on as garbage."""
    from transformers.models.falcon_h1 import modeling_falcon_h1 as falcon_h1

    init = falcon_h1.FalconH1PreTrainedModel._init_weights

    def without_mup_vector(self, module):
        if not isinstance(module, falcon_h1.FalconH1Model):
            init(self, module)

    monkeypatch.setattr(falcon_h1.FalconH1PreTrainedModel, "_init_weights", without_mup_vector)
    with pytest.raises(ValueError, match=r"^FalconH1ForCausalLM: transformers' initializer leaves "
                                         r"model.layers.0.mamba.mup_vector, model.layers.1.mamba.mup_vector unset: "
                                         r"start from the model's weights"):
        _seeded()


def test_a_tensor_the_checkpoint_fills_need_not_be_set_by_the_initializer(monkeypatch, tmp_path):
    """From a checkpoint, the initializer only has to set what the state dict does not hold (the mup_vector
    buffers): an initializer that sets none of the mixer's parameters (here Falcon-H1's without its mixer branch)
    is not refused, and the checkpoint's values are the ones trained."""
    from transformers.models.falcon_h1 import modeling_falcon_h1 as falcon_h1

    from memtrain.models import build_model

    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon_h1", **FALCON_H1))
    saved.save_pretrained(tmp_path / "model")
    init = falcon_h1.FalconH1PreTrainedModel._init_weights

    def without_mixer(self, module):
        if not isinstance(module, falcon_h1.FalconH1Mixer):
            init(self, module)

    monkeypatch.setattr(falcon_h1.FalconH1PreTrainedModel, "_init_weights", without_mixer)
    plm = parallelize(build_model(str(tmp_path / "model"), device="meta"), parallel.Grid(1, 1, 1, 1), "easy")
    got = plm.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved.state_dict().items() if "A_log" in k or k.endswith(".D"))
    assert all(torch.equal(b, dict(saved.named_buffers())[name.removeprefix("model.")])
               for name, b in plm.named_buffers())
