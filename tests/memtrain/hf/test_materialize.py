"""memtrain/hf/materialize.py: parallelize from the seed on a model built on the meta device. The tensors no
engine layer holds (norms, buffers) get transformers' own initial values, and none is left as whatever the
allocator held.

Reference: the plain transformers model built on a CPU, initialized by transformers itself. Falcon-H1 is the
model: its model module, not the mixer holding them, sets each mixer's mup_vector buffer (a parent's init), and
the tests strip parts of its initializer to make the cases that no family in transformers shows today.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.falcon_h1 import modeling_falcon_h1 as falcon_h1

import parallel
from memtrain.hf import parallelize
from memtrain.models import build_model

INIT = falcon_h1.FalconH1PreTrainedModel._init_weights  # transformers' own, before any test replaces it
FALCON_H1 = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8)


def _seeded(**kwargs):
    config = AutoConfig.for_model("falcon_h1", **FALCON_H1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, parallelize(model, parallel.Grid(1, 1, 1, 1), "easy", seed=0, device="cpu", **kwargs)


def _init_only(monkeypatch, keep):
    """Falcon-H1's initializer, run for the modules `keep(module)` accepts, nothing for the others."""
    def some(self, module):
        if keep(module):
            INIT(self, module)

    monkeypatch.setattr(falcon_h1.FalconH1PreTrainedModel, "_init_weights", some)


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
    """An initializer that sets nothing for a tensor leaves it unset: refused, not trained on as garbage. A buffer
    no checkpoint holds (Falcon-H1's init without its mup_vector line) cannot come from weights either; a
    parameter (without its mixer branch) can, and the refusal says so."""
    _init_only(monkeypatch, lambda m: not isinstance(m, falcon_h1.FalconH1Model))
    with pytest.raises(ValueError, match=r"^FalconH1ForCausalLM: transformers' initializer leaves "
                                         r"model.layers.0.mamba.mup_vector, model.layers.1.mamba.mup_vector unset: "
                                         r"a buffer no checkpoint holds"):
        _seeded()
    _init_only(monkeypatch, lambda m: not isinstance(m, falcon_h1.FalconH1Mixer))
    with pytest.raises(ValueError, match=r"leaves model.layers.0.mamba.dt_bias, .* unset: start from the model's "
                                         r"weights \(model.init"):
        _seeded()


def test_an_ancestors_init_keeps_off_what_is_set_and_is_refused_where_it_cannot(monkeypatch):
    """The ancestors' pass marks every tensor already set. An init that reaches one through torch.nn.init (as a
    model's own code may) leaves it alone under transformers' guard; one that writes it directly is refused,
    since the engine drew it from the seed on this grid."""
    _, plm = _seeded()
    want = plm.full_state_dict()["model.embed_tokens.weight"]

    def through_torch_init(self, module):
        INIT(self, module)
        if isinstance(module, falcon_h1.FalconH1Model):
            torch.nn.init.normal_(module.embed_tokens.weight)

    monkeypatch.setattr(falcon_h1.FalconH1PreTrainedModel, "_init_weights", through_torch_init)
    _, plm = _seeded()
    assert torch.equal(plm.full_state_dict()["model.embed_tokens.weight"], want)

    def directly(self, module):
        INIT(self, module)
        if isinstance(module, falcon_h1.FalconH1Model):
            with torch.no_grad():
                module.embed_tokens.weight.mul_(2)

    monkeypatch.setattr(falcon_h1.FalconH1PreTrainedModel, "_init_weights", directly)
    with pytest.raises(ValueError, match=r"initializer rewrites model.embed_tokens.weight when it sets"):
        _seeded()


@pytest.mark.parametrize("weights", ["a model directory", "model.init"])
def test_what_the_weights_fill_need_not_be_set_by_the_initializer(monkeypatch, tmp_path, weights):
    """Where a checkpoint follows (a model directory with weights, or the trainer's model.init: loaded_next), the
    initializer only has to set what no state dict holds: one that sets none of the mixer's parameters is not
    refused, and the checkpoint's values are the ones trained."""
    torch.manual_seed(0)
    saved = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon_h1", **FALCON_H1))
    saved.save_pretrained(tmp_path / "model")
    _init_only(monkeypatch, lambda m: not isinstance(m, falcon_h1.FalconH1Mixer))
    if weights == "model.init":
        _, plm = _seeded(loaded_next=True)
        plm.load_hf_state_dict(saved.state_dict())
    else:
        plm = parallelize(build_model(str(tmp_path / "model"), device="meta"), parallel.Grid(1, 1, 1, 1), "easy")
    got = plm.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved.state_dict().items() if "A_log" in k or k.endswith(".D"))
    assert all(torch.equal(b, dict(saved.named_buffers())[name.removeprefix("model.")])
               for name, b in plm.named_buffers())
