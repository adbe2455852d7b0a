"""The model ladder: named transformers configs, built from config with no download.

    model = build_model("ladder-10m", vocab_size=tokenizer_vocab)        # random init, seeded
    model = build_model("llama-3.1-405b", device="meta")                 # shapes only, nothing allocated
    model = build_model("/path/to/hf_dir")                               # from_pretrained, local files
    model = build_model("/path/to/config_dir")                           # only config.json: seeded init

Families:
- `width-*`: the size study's ladder. Llama blocks scaled in one way only, width at fixed depth: 2 layers,
  heads of 32 dimensions (width / 32 of them, one at width 32), SwiGLU at 8/3 of the width (a multiple of
  8), untied embeddings. At a 2048-token vocabulary: width-32 0.16M parameters, -64 0.36M, -128 0.92M,
  -256 2.6M, -384 5.1M, -512 8.4M. Learning rates follow the width rule of train.lr_width.
- `ladder-*`: Llama-architecture models from ~1M to ~100M parameters at vocab 4096 (a locally trained
  tokenizer's size), depth growing with width. Hidden size, heads, kv heads and intermediate size are all
  multiples of 8 so every 8-rank grid fits in sharded mode; embeddings are untied (as in Llama 3).
- `llama-3.1-8b/70b/405b`, `llama-3.2-1b`, `pythia-*` (GPT-NeoX), `gpt2`: the real shapes of the published
  models, to simulate them (device="meta") or train them with random init; load real weights with a local
  directory and `ParallelLM.load_hf_state_dict`. `llama-3.2-1b` is the GPU default of experiments/bench/train.py.
- `gpt2-tiny`: a 2-layer GPT-2 for tests and demos.

Attention is torch's scaled_dot_product_attention (transformers' "sdpa": flash or memory-efficient kernels on
CUDA) for every architecture transformers implements it for, asked for by name so no change of transformers'
default can switch it. The engine runs these attention modules as they are (parallelize replaces linears,
embeddings and norms), so it is the training path too. Exceptions: an architecture without an SDPA path in
transformers (Bloom, GPT-J, GPT-Neo, Gemma 2...) gets transformers' eager attention, and a model with its own code
(trust_remote_code) its own choice. `build_model(name, attn_implementation="eager")` builds the eager reference.

Dropout is 0 in every named config: one-pass memorization runs train without it, and in sharded mode
replicated activations would otherwise need identical dropout masks on every replica.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from pathlib import Path

import torch
from safetensors import SafetensorError

from memtrain.files import read_json
from memtrain.progress import note
from memtrain.run_files import MODEL_DIR, MODEL_SOURCE

LADDER_VOCAB = 4096
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.h5",
                 "*.msgpack", "*.gguf")

_LLAMA_31 = dict(
    model_type="llama", vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072,
    rms_norm_eps=1e-5, hidden_act="silu", initializer_range=0.02, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)
_PYTHIA = dict(
    model_type="gpt_neox", vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25,
    rotary_emb_base=10000, use_parallel_residual=True, tie_word_embeddings=False, layer_norm_eps=1e-5,
    hidden_act="gelu", initializer_range=0.02, attention_bias=True, hidden_dropout=0.0,
    attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
)
_GPT2 = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0, initializer_range=0.02, tie_word_embeddings=True, layer_norm_epsilon=1e-5,
             bos_token_id=50256, eos_token_id=50256)


def _ladder(hidden, layers, heads, kv_heads, intermediate):
    return dict(model_type="llama", vocab_size=LADDER_VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act="silu", initializer_range=0.02,
                tie_word_embeddings=False, attention_dropout=0.0,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0))


def _width(hidden, layers=2, head_dim=32):
    heads = max(1, hidden // head_dim)
    return _ladder(hidden, layers, heads, heads, 8 * round(hidden * 8 / 3 / 8))


def _pythia(hidden, layers, heads, vocab=50304):
    return dict(_PYTHIA, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                intermediate_size=4 * hidden, vocab_size=vocab)


# name -> config keyword arguments (model_type selects the transformers config class).
MODELS: dict[str, dict] = {
    **{f"width-{w}": _width(w) for w in (32, 64, 128, 256, 384, 512)},
    #                        hidden layers heads kv  intermediate   ~params at vocab 4096
    "ladder-1m": _ladder(64, 6, 8, 8, 256),        # 0.92M
    "ladder-3m": _ladder(128, 8, 8, 8, 384),       # 2.8M
    "ladder-10m": _ladder(256, 10, 8, 8, 704),     # 10.1M
    "ladder-30m": _ladder(512, 8, 8, 8, 1408),     # 29.9M
    "ladder-100m": _ladder(768, 12, 16, 8, 2560),  # 98.3M (GQA: 2 query heads per kv head)
    "llama-3.1-8b": dict(_LLAMA_31, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         intermediate_size=14336),
    "llama-3.1-70b": dict(_LLAMA_31, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                          intermediate_size=28672),
    "llama-3.1-405b": dict(_LLAMA_31, hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                           intermediate_size=53248),
    # Llama 3.2 1B: 3.1's recipe at 1B, tied embeddings, RoPE stretched 32x (1.24B; 0.98B at vocab 4096)
    "llama-3.2-1b": dict(_LLAMA_31, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         intermediate_size=8192, tie_word_embeddings=True,
                         rope_parameters=dict(_LLAMA_31["rope_parameters"], factor=32.0)),
    "pythia-14m": _pythia(128, 6, 4),
    "pythia-70m": _pythia(512, 6, 8),
    "pythia-160m": _pythia(768, 12, 12),
    "pythia-410m": _pythia(1024, 24, 16),
    "pythia-1b": _pythia(2048, 16, 8),
    "pythia-1.4b": _pythia(2048, 24, 16),
    "pythia-2.8b": _pythia(2560, 32, 32),
    "pythia-6.9b": _pythia(4096, 32, 32, vocab=50432),
    "pythia-12b": _pythia(5120, 36, 40, vocab=50688),
    "gpt2": dict(_GPT2, n_embd=768, n_layer=12, n_head=12),
    "gpt2-tiny": dict(_GPT2, vocab_size=LADDER_VOCAB, n_embd=64, n_layer=2, n_head=8, bos_token_id=None,
                      eos_token_id=None),
}


def list_models() -> list[str]:
    return list(MODELS)


def _unknown(name: str) -> ValueError:
    close = difflib.get_close_matches(name.lower(), MODELS, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    return ValueError(f"unknown model {name!r}: {hint}Named models: {', '.join(MODELS)}; or give a local "
                      "HF model directory or a hub id (owner/name)")


def get_config(name: str, vocab_size: int | None = None, **overrides):
    """The transformers config of a named model; vocab_size and overrides replace its fields."""
    from transformers import AutoConfig

    if name not in MODELS:
        raise _unknown(name)
    kwargs = dict(MODELS[name], **overrides)
    if vocab_size is not None:
        kwargs["vocab_size"] = int(vocab_size)
        # A local tokenizer brings its own special tokens: drop ids it cannot hold (GPT-2's 50256...).
        for k in ("bos_token_id", "eos_token_id"):
            if (kwargs.get(k) or 0) >= kwargs["vocab_size"]:
                kwargs[k] = None
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def _attention(config, trust_remote_code: bool) -> str | None:
    """The attention implementation to build `config` with (module docstring): the caller's override, else "sdpa"
    where transformers has it for the architecture, else None (transformers' choice)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if config._attn_implementation is not None:
        return config._attn_implementation
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return None  # the directory's own class, which may have no SDPA path
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else None


def _from_config(config, device, dtype, seed: int, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    device = torch.device(device or "cpu")
    with seeded_rng(seed, device), device:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                attn_implementation=_attention(config, trust_remote_code))


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device):
    """torch's CPU generator and `device`'s own seeded, and both restored on exit. HF draws its random init from
    these global generators; a caller's draws must not move, and no other GPU's generator is touched (torch.manual_seed
    would reseed every GPU's)."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(seed)
        yield


def _hub_error(name: str, err: Exception) -> OSError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    why = "the hub is offline (HF_HUB_OFFLINE=1)" if offline else "it could not be fetched from the hub"
    return OSError(f"model {name!r} is not a named model nor a local directory, and {why} "
                   f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Download it to a "
                   f"directory on a machine with network and pass that path, or use a named model: "
                   f"{', '.join(MODELS)}")


def _local_dir(name: str, trust_remote_code: bool) -> Path:
    """A local directory holding the model: the path itself, or a hub snapshot (fetched if online)."""
    if os.path.isdir(name):
        return Path(name)
    if "/" not in name or name.startswith((".", "/")):
        raise _unknown(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # offline, unreachable, unknown repository, gated...
        raise _hub_error(name, e) from None


def holds_weights(path: Path) -> bool:
    """Whether a directory holds weight files (else it is an architecture: a config saved alone)."""
    return any(next(path.glob(pattern), None) is not None for pattern in _WEIGHT_FILES)


def build_model(name_or_path: str, vocab_size: int | None = None, *, device=None, dtype=None, seed: int = 0,
                trust_remote_code: bool = False, eos_token_id: int | None = None, **overrides):
    """A transformers causal LM: a named model from config, or a checkpoint from a directory or the hub.

    A local directory without weight files (a config saved with save_pretrained) is an architecture, not a
    checkpoint: it starts from the seeded init like a named model.

    vocab_size: for named models and config-only directories, replaces the config's (a locally trained tokenizer
        drives it); a checkpoint must have been trained with that tokenizer (`_check_tokenizer_fits`).
    eos_token_id: the tokenizer's EOS, checked against a checkpoint's (and given to an architecture's config).
    device="meta": build the shapes without allocating. For a checkpoint the weights stay on disk: the
        returned model records their directory and `parallelize` loads them, slice by slice, into the shards.
    overrides: config fields to replace (e.g. num_hidden_layers=2, attn_pdrop=0.0, attn_implementation="eager").
    """
    if name_or_path in MODELS:
        return _from_config(get_config(name_or_path, vocab_size, **overrides), device, dtype, seed)
    path = _local_dir(name_or_path, trust_remote_code)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **overrides)
    except Exception as e:  # noqa: BLE001 - a damaged config.json: ValueError, TypeError, huggingface_hub's own
        if trust_remote_code or "trust_remote_code" not in str(e):  # (transformers' messages span lines)
            raise ValueError(f"model {name_or_path!r}: its config.json is not a model config transformers reads "
                             f"({' '.join(str(e).split())[:200]}): restore it, or save the model again") from None
        raise ValueError(f"model {name_or_path!r} needs the Python code in its directory (auto_map in its config.json)"
                         ", which runs only with --trust-remote-code on the command line: pass it if you trust that "
                         "code") from None
    # Only a local directory can be config-only: a hub snapshot fetches *.safetensors alone, so a repository
    # with .bin weights would look weightless and silently train from scratch.
    held = _kept_weights(path)
    weights = held if held is not None else (not os.path.isdir(name_or_path) or holds_weights(path))
    if vocab_size is not None and not weights:  # an architecture: its table is sized to the tokenizer that drives it
        config.vocab_size = int(vocab_size)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(config, k, eos_token_id if k == "eos_token_id" else None)
    elif vocab_size is not None:
        _check_tokenizer_fits(config, vocab_size, eos_token_id, name_or_path)
    # A run's copy of its directory holds no weights (its checkpoints do): the architecture, sized as it was
    if not weights or held is not None or torch.device(device or "cpu").type == "meta":
        model = _from_config(config, device, dtype, seed, trust_remote_code)
        if weights and held is None:
            model.memtrain_weights = str(path)  # parallelize loads them, slice by slice, into the shards
        return model
    try:  # the default dtype, not transformers' "auto" (a bf16 checkpoint in bf16): the dtype a grid builds it in
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=dtype or torch.get_default_dtype(), trust_remote_code=trust_remote_code,
            attn_implementation=_attention(config, trust_remote_code), output_loading_info=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # a damaged weights file
        raise ValueError(f"model {name_or_path!r}: its weights do not load ({' '.join(str(e).split())[:200]}): "
                         "restore them, or save the model again") from None
    # transformers fills what the files lack with a random init and goes on: a checkpoint must hold the model whole
    gaps = [f"{what} {sorted(map(str, keys))[:3]}" for what, keys in (("missing", info["missing_keys"]),
                                                                      ("unexpected", info["unexpected_keys"]),
                                                                      ("of another shape", info["mismatched_keys"]))
            if keys]
    if gaps:
        raise ValueError(f"model {name_or_path!r}: its weights do not fit its config.json ({'; '.join(map(str, gaps))}"
                         "): restore the files, or save the model again with save_pretrained")
    return model.to(device) if device is not None else model


def _kept_weights(path: Path) -> bool | None:
    """For a run's copy of its model directory (run_files.MODEL_DIR): whether that directory held weights, which
    decides the vocabulary as it did in training (a checkpoint keeps its table, an architecture is sized to the
    tokenizer). None for any other directory."""
    if path.name != MODEL_DIR or not (path / MODEL_SOURCE).is_file():
        return None
    source = read_json(path / MODEL_SOURCE, "model copy file", "restore the run directory from a copy")
    return bool(source.get("weights"))


UNUSED_ROWS = 128
"""Embedding rows a checkpoint may have beyond its tokenizer: tables are padded (Pythia: 50,304 rows for 50,277
tokens) but not by thousands."""


def _check_tokenizer_fits(config, vocab_size: int, eos_token_id: int | None, name: str) -> None:
    """Refuse a checkpoint beside a tokenizer it was not trained with: an id past its table would crash, a table
    far larger than the tokenizer means another vocabulary (every id means another token), and another EOS id
    means documents end where the model never learned they do."""
    fix = f"train with the model's own tokenizer: --set data.tokenizer={name}"
    if vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size:,} tokens but model {name!r} only {config.vocab_size:,} "
                         f"embedding rows: {fix}")
    if config.vocab_size - vocab_size > UNUSED_ROWS:
        unused = 1 - vocab_size / config.vocab_size
        raise ValueError(f"model {name!r} has {config.vocab_size:,} embedding rows but the tokenizer {vocab_size:,} "
                         f"tokens ({unused:.0%} of the rows never used): it is not the model's tokenizer; {fix}")
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    if eos_token_id is not None and eos != [None] and eos_token_id not in eos:
        raise ValueError(f"model {name!r} ends a text with token id {eos[0]} but the tokenizer's EOS is id "
                         f"{eos_token_id}: {fix}")


def allow_remote_code(cfg, allowed: bool, source: str) -> None:
    """Set cfg.model.trust_remote_code from the --trust-remote-code flag of the command being run, and from nothing
    else: a file saying true (a recipe, or the config.toml of a run directory someone sent) never makes a model
    directory's Python run. `source` names where cfg was read, for the warning."""
    if allowed:
        note("warning: --trust-remote-code: Python files in the model's directory will run with your permissions")
    elif cfg.model.trust_remote_code:
        note(f"warning: model.trust_remote_code = true in {source} is ignored: only --trust-remote-code on the "
             "command line lets a model directory's code run")
    cfg.model.trust_remote_code = allowed


def param_count(name: str, vocab_size: int | None = None) -> int:
    """Number of parameters of a named model (tied weights once), counted on the meta device."""
    model = build_model(name, vocab_size, device="meta")
    return sum(p.numel() for p in model.parameters())
