"""Tiny randomly initialised causal LMs for the eval tests (no hub access)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig

VOCAB = 256


def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, hidden: int = 64, layers: int = 2,
               init_std: float = 0.2):
    """A seeded tiny model. EOS is disabled so `generate` always emits exactly max_new_tokens."""
    common = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **common)
    elif arch == "neox":
        cfg = GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                            num_attention_heads=4, max_position_embeddings=256, **common)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=256, **common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    # The default 0.2 (vs 0.02) spreads the logits, so random models make varied greedy choices with
    # clear margins and a decoding bug shows up as different tokens.
    cfg.initializer_range = init_std
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def train_to_memorize(model, seqs, steps: int = 200, lr: float = 3e-3):
    """Full-batch Adam on `seqs` (equal length) until the model reproduces them."""
    batch = torch.tensor(seqs, dtype=torch.long)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


