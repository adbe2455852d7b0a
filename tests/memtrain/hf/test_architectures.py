"""Easy mode's plan for any causal LM (memtrain/hf/architectures.py): which layers become engine layers, and
families of every kind of block train as their plain model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parallel
from memtrain.hf import parallelize
from parallel.forked import run_ranks
from tests.memtrain._models import tiny
from tests.memtrain.hf._training import LOSS_TOL, SEED, assert_trains_as_plain, plm_train

READ_AS_MATRIX = {"mamba": ["backbone.layers.0.mixer.dt_proj", "backbone.layers.1.mixer.dt_proj"],
                  "falcon_mamba": ["backbone.layers.0.mixer.dt_proj", "backbone.layers.1.mixer.dt_proj"],
                  "jamba": ["model.layers.0.mamba.dt_proj"]}
"""The layers each family's forward reads as `layer.weight @ x` (Jamba's block 1 is attention)."""

C = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         intermediate_size=64)
FAMILIES = {  # state-space, hybrid, linear-attention, convolution and mixture-of-experts blocks
    "mamba2": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8, num_heads=4, head_dim=16,
                   n_groups=1, expand=2, chunk_size=8),
    "bamba": dict(C, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=8, attn_layer_indices=[1]),
    "granitemoehybrid": dict(C, num_local_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_n_heads=4,
                             mamba_d_head=16, mamba_chunk_size=8, layer_types=["mamba", "attention"]),
    "nemotron_h": dict(C, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8,
                       hybrid_override_pattern="M*", head_dim=8),
    "rwkv": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
                 context_length=64),
    "qwen3_next": dict(C, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"]),
    "lfm2": dict(C, layer_types=["conv", "full_attention"], block_ff_dim=64),
    "mixtral": dict(C, num_local_experts=2, num_experts_per_tok=1),
    "olmoe": dict(C, num_experts=2, num_experts_per_tok=1),
    "gpt_oss": dict(C, num_local_experts=2, num_experts_per_tok=1, head_dim=8,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=4),
}


def _split(plm):
    """(names of the layers left whole, number of engine Linears)."""
    whole = sorted(n for n, m in plm.model.named_modules() if type(m) is nn.Linear)
    return whole, sum(isinstance(m, parallel.Linear) for m in plm.model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_more_families_train_as_their_plain_model(family):
    """Families easy mode was never written for, each a kind of block of its own: every Linear becomes an engine
    layer, and per-token losses and every gradient equal the plain model's within 1e-5 relative (measured ~1e-7)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **FAMILIES[family]))
    plm = parallelize(copy.deepcopy(ref), parallel.Grid(1, 1, 1, 1), "easy", weights="model")
    assert _split(plm)[0] == []
    assert_trains_as_plain(ref, plm)


@pytest.mark.parametrize("family", READ_AS_MATRIX)
def test_a_layer_the_forward_reads_as_a_matrix_stays_whole(family):
    """An engine layer holds its weight as a flat shard: Mamba's `dt_proj.weight @ x` was a shape error at the first
    step. Such a layer stays a whole, replicated nn.Linear, every other one becomes an engine layer, and per-token
    losses and every gradient equal the plain model's within 1e-5 relative (fp32: the engine's loss sums in
    another order; measured 5e-7). Jamba's probe forward fails on the meta device in fp32 (torch's grouped GEMM of
    its experts takes bf16 there) and is answered in bf16."""
    ref = tiny(family)
    plm = parallelize(copy.deepcopy(ref), parallel.Grid(1, 1, 1, 1), "easy", weights="model")
    whole, engine = _split(plm)
    linears = sum(type(m) is nn.Linear for m in ref.modules()) - 1  # the LM head is the engine's LMHead
    assert whole == READ_AS_MATRIX[family] and engine == linears - len(whole)
    assert_trains_as_plain(ref, plm)


def test_the_seeded_init_of_a_whole_layer_is_its_models():
    """transformers initializes a model's layers before their parents, so Mamba's mixer sets its time-step layer
    after the layer's own init: a bias whose softplus, the initial time step, lies in [time_step_min,
    time_step_max]. Initialized parents last, the seeded init does too (the layer's own init leaves a zero bias:
    softplus 0.69)."""
    plm = parallelize(tiny("mamba", "meta"), parallel.Grid(1, 1, 1, 1), "easy", seed=SEED, device="cpu")
    cfg = plm.config
    for layer in READ_AS_MATRIX["mamba"]:
        step = F.softplus(plm.model.get_submodule(layer).bias.detach())
        low, high = cfg.time_step_min * (1 - 1e-5), cfg.time_step_max * (1 + 1e-5)  # float32 rounding
        assert low <= float(step.min()) <= float(step.max()) <= high


def test_an_init_that_rescales_an_engine_layer_is_refused_unless_weights_follow():
    """Mamba's rescale_prenorm_residual divides out_proj's weight in place after drawing it (`p /= sqrt(n)`): on
    the engine's seeded shard that would be a rescale of another init, so the seeded init is refused with its fix;
    with weights loaded next (model.init) the rescaled values are overwritten anyway, and the load is exact."""
    with pytest.raises(ValueError, match=r"rewrites backbone.layers.0.mixer.out_proj.weight, .*start from the "):
        parallelize(tiny("mamba", "meta", rescale_prenorm_residual=True), parallel.Grid(1, 1, 1, 1), "easy",
                    seed=SEED, device="cpu")
    ref = tiny("mamba", rescale_prenorm_residual=True)
    plm = parallelize(tiny("mamba", "meta", rescale_prenorm_residual=True), parallel.Grid(1, 1, 1, 1), "easy",
                      seed=SEED, device="cpu", loaded_next=True)
    plm.load_hf_state_dict(ref.state_dict())
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in plm.full_state_dict().items())


def _mamba_trains(rank, world):
    grid = parallel.Grid(1, 1, world, 1, rank=rank)
    grid.build_groups()
    plm = parallelize(tiny("mamba", "meta"), grid, "easy", seed=SEED, device="cpu")
    init = plm.full_state_dict()
    losses, _, _ = plm_train(plm, grid)
    return init, losses, plm.full_state_dict()


def test_a_whole_layer_trains_alike_on_a_grid():
    """The whole layer is replicated: its gradient is summed over the ranks' rows like a norm's. The seeded init and
    3 AdamW steps on Y=2 equal one process: initial weights exactly (HF's own init for the whole layer, drawn alike on
    every rank), losses within 1e-5 relative, weights within 2e-4 (_training.py's tolerances and why)."""
    init, losses, final = _mamba_trains(0, 1)
    for got_init, got_losses, got_final in run_ranks(2, _mamba_trains):
        assert all(torch.equal(got_init[k], init[k]) for k in init)
        assert max(abs(a / b - 1) for a, b in zip(got_losses, losses)) < LOSS_TOL
        assert max(float((got_final[k] - final[k]).abs().max()) for k in final) < 2e-4


class NoMetaLlama(type(tiny("llama", "meta"))):
    """A model whose forward reads a value (as a data-dependent branch would): it cannot run on the meta device."""

    def forward(self, input_ids=None, **kw):
        if input_ids.max().item() < 0:
            raise AssertionError("unreachable")
        return super().forward(input_ids=input_ids, **kw)


def test_a_forward_the_meta_device_cannot_run_leaves_every_layer_to_the_engine():
    """BioGPT's forward reads a value (`.item()`), which the meta device has not: the probe tells nothing, every
    Linear becomes an engine layer and its config fields alone stand for its logits, as before the probe. A model's
    own code that cannot run there is refused: nothing shows what it does to its logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("biogpt", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plm = parallelize(model, parallel.Grid(1, 1, 1, 1), "easy", device="meta")
    assert _split(plm) == ([], 6)
    with pytest.raises(ValueError, match="NoMetaLlama: its own code does not run on the meta device"):
        parallelize(NoMetaLlama(tiny("llama", "meta").config), parallel.Grid(1, 1, 1, 1), "easy", device="meta")
