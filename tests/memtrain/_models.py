"""Tiny HF models whose every size splits over 8 ranks, for the memtrain.hf and memtrain.plan tests."""

import os

import torch

from memtrain.models import build_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny(family, device=None, **kw):
    """One-layer models whose every size splits over 8 ranks on any axis (vocab 99 is padded instead)."""
    if family == "llama":  # 16 query heads sharing 8 kv heads, head_dim 4
        return build_model("ladder-1m", 128, device=device, **dict(dict(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8,
            intermediate_size=96), **kw))
    if family == "neox":  # head_dim 8, rotary on 2 of them (rotary_pct 0.25), parallel residual
        return build_model("pythia-14m", 128, device=device, hidden_size=64, num_hidden_layers=1,
                           num_attention_heads=8, intermediate_size=128, **kw)
    if family == "gpt2":
        return build_model("gpt2-tiny", 99, device=device, n_embd=32, n_layer=1, n_head=8, n_positions=16, **kw)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **dict(GENERIC[family], **kw))
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(cfg)


GENERIC = {  # families memtrain has no plan for (easy mode only)
    # learned positions with an offset, biases, tied embeddings
    "opt": dict(vocab_size=96, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
                max_position_embeddings=16, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0),
    # ALiBi built from a 2-D attention mask
    "bloom": dict(vocab_size=96, hidden_size=32, n_layer=1, n_head=4, hidden_dropout=0.0, attention_dropout=0.0),
    # ALiBi of its own, a mask that ignores position ids
    "mpt": dict(vocab_size=96, d_model=32, n_layers=1, n_heads=4, expansion_ratio=2),
    # state-space blocks whose time-step projection is read as `dt_proj.weight @ x`, not called as a layer
    "mamba": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8),
    "falcon_mamba": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8),
    # attention and Mamba-2 side by side in every block (a cache of both)
    "falcon_h1": dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8),
    # Mamba and attention blocks, MoE experts every other block
    "jamba": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_dt_rank=8),
}
