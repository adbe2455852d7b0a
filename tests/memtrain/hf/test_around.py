"""What a model does around the embedding and LM head the engine replaces (scaled lookups, transformed logits):
carried by the engine's layers, on one process and on a split vocabulary, or refused with a message naming it
when the model's own code does it in a way the engine cannot see through."""

import copy

import pytest
import torch
import torch.nn.functional as F

import parallel
from memtrain.hf import parallelize
from parallel.forked import run_ranks
from tests.memtrain._models import tiny
from tests.memtrain.hf._training import LOSS_TOL, B, S, assert_trains_as_plain, batch

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
