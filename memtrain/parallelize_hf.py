"""Sharded-mode plans for the architectures memtrain knows: Llama, GPT-NeoX (Pythia), GPT-2.

One function per architecture replaces the modules of a built transformers model (5.23) and leaves
HF's forward code to run through them. The layout is the same for all three (DESIGN.md section 3):

    residual stream    [rows, H/x], replicated over Y            embedding, norms (sharded over X)
    q/k/v, gate/up     normal Linear: in over X, out over Y      -> this Y member's heads / columns
    o, down            transposed Linear: in over Y, out over X  -> back to [rows, H/x]

Attention modules then see only their Y member's heads. HF reshapes q/k/v with `view(..., -1, head_dim)`,
so the local head count follows from the local width; GQA keeps its query-per-kv ratio when both head
counts split over Y; only GPT-2 keeps a width attribute (`split_size`) that must be set to the local one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from memtrain.hf_shards import Builder, check_divisible


def _check_sizes(grid, heads: int, kv_heads: int, hidden: int, intermediate: int) -> None:
    check_divisible("num_attention_heads", heads, grid, "y", "attention heads are split over Y")
    if kv_heads != heads:
        check_divisible("num_key_value_heads", kv_heads, grid, "y", "kv heads are split over Y")
    check_divisible("hidden_size", hidden, grid, "x", "the residual stream is split over X")
    check_divisible("intermediate_size", intermediate, grid, "y", "MLP columns are split over Y")


def plan_llama(model, b: Builder) -> None:
    cfg, grid = model.config, b.grid
    _check_sizes(grid, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size, cfg.intermediate_size)
    emb = b.embedding("model.embed_tokens")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            b.linear(f"{p}.self_attn.{name}")
        b.linear(f"{p}.self_attn.o_proj", transpose=True)
        b.linear(f"{p}.mlp.gate_proj")
        b.linear(f"{p}.mlp.up_proj")
        b.linear(f"{p}.mlp.down_proj", transpose=True)
        b.norm(f"{p}.input_layernorm")
        b.norm(f"{p}.post_attention_layernorm")
    b.norm("model.norm")
    b.lm_head("lm_head", emb if cfg.tie_word_embeddings else None)


def plan_gpt_neox(model, b: Builder) -> None:
    # query_key_value rows are head-interleaved ([q_h, k_h, v_h] per head h, as HF's view(..., -1, 3*d)
    # reads them), so a contiguous block of rows is a group of whole heads: no reordering needed.
    cfg, grid = model.config, b.grid
    heads = cfg.num_attention_heads
    _check_sizes(grid, heads, heads, cfg.hidden_size, cfg.intermediate_size)
    emb = b.embedding("gpt_neox.embed_in")
    for i in range(cfg.num_hidden_layers):
        p = f"gpt_neox.layers.{i}"
        b.linear(f"{p}.attention.query_key_value")
        b.linear(f"{p}.attention.dense", transpose=True)
        b.linear(f"{p}.mlp.dense_h_to_4h")
        b.linear(f"{p}.mlp.dense_4h_to_h", transpose=True)
        b.norm(f"{p}.input_layernorm")
        b.norm(f"{p}.post_attention_layernorm")
    b.norm("gpt_neox.final_layer_norm")
    b.lm_head("lm_head", emb if cfg.tie_word_embeddings else None)


class ColumnEmbedding(nn.Module):
    """A small table [rows, H] kept whole in rows and split over X in columns (GPT-2's wpe)."""

    def __init__(self, rows: int, hidden: int, grid, device=None, dtype=None):
        super().__init__()
        from parallel import tag

        self.weight = tag(nn.Parameter(torch.empty(rows, hidden // grid.x, device=device, dtype=dtype)),
                          ("x",), ("z", "data"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


def qkv_rows(hidden: int, y: int) -> torch.Tensor:
    """GPT-2's fused [q | k | v] rows reordered so Y member j holds [q_j | k_j | v_j] (its heads' rows)."""
    n = hidden // y
    return torch.cat([torch.arange(part * hidden + j * n, part * hidden + (j + 1) * n)
                      for j in range(y) for part in range(3)])


def plan_gpt2(model, b: Builder) -> None:
    cfg, grid = model.config, b.grid
    if cfg.add_cross_attention:
        raise ValueError("GPT-2 with cross-attention is not a causal LM memtrain can shard: use mode='easy'")
    hidden, heads = cfg.n_embd, cfg.n_head
    inner = cfg.n_inner or 4 * hidden
    _check_sizes(grid, heads, heads, hidden, inner)
    emb = b.embedding("transformer.wte")
    rows, _ = model.transformer.wpe.weight.shape
    wpe = ColumnEmbedding(rows, hidden, grid, device="meta", dtype=b.dtype)
    b._set("transformer.wpe", wpe)
    b.part("transformer.wpe.weight", wpe, "weight", full_shape=(rows, hidden), axis="x", init="normal",
           std=b.std_of("transformer.wpe.weight"))
    perm = qkv_rows(hidden, grid.y)
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}"
        b.linear(f"{p}.attn.c_attn", hf_rows=perm)
        b.linear(f"{p}.attn.c_proj", transpose=True)
        b.linear(f"{p}.mlp.c_fc")
        b.linear(f"{p}.mlp.c_proj", transpose=True)
        b.norm(f"{p}.ln_1")
        b.norm(f"{p}.ln_2")
        # transformers 5.23 splits c_attn's output with `split_size` (q, k, v widths); heads follow from
        # head_dim. Both attributes become this member's share.
        attn = model.get_submodule(f"{p}.attn")
        attn.split_size, attn.num_heads = hidden // grid.y, heads // grid.y
    b.norm("transformer.ln_f")
    b.lm_head("lm_head", emb if cfg.tie_word_embeddings else None)


PLANS = {"llama": plan_llama, "gpt_neox": plan_gpt_neox, "gpt2": plan_gpt2}


def init_std_rule(config):
    """std of the seeded init per HF name: config.initializer_range, and GPT-2's residual projections
    scaled by 1/sqrt(2 * n_layer) as HF (and the GPT-2 paper) initialize them."""
    std = getattr(config, "initializer_range", 0.02) or 0.02
    if config.model_type == "gpt2":
        scaled = std / math.sqrt(2 * config.n_layer)
        return lambda key: scaled if key.endswith("c_proj.weight") else std
    return lambda key: std


def aliases_for(model, keys: list[str]) -> dict[str, tuple[str, ...]]:
    """Names a checkpoint may use for each key: HF's own, without the base-model prefix (GPT-2 hub
    files say 'h.0...' for 'transformer.h.0...'), and GPT-NeoX's older 'embed_out' LM head."""
    prefix = model.base_model_prefix + "."
    out = {}
    for k in keys:
        names = [k]
        if k.startswith(prefix):
            names.append(k[len(prefix):])
        if model.config.model_type == "gpt_neox" and k == "lm_head.weight":
            names.append("embed_out.weight")
        out[k] = tuple(names)
    return out
