"""What memtrain knows of each transformers architecture, one object per architecture.

An `Architecture` holds everything that differs between families: the layers of one block (the single
list both the sharded plan and the planner's cost model read), the module paths of the ends, the seeded
init's std per HF name, and the names a checkpoint may use. `parallelize` asks `architecture_of(config)`
once. Adding an architecture means adding a class here and listing it in ARCHITECTURES.

The sharded layout is the same for every family (parallel/linear.py's docstring):

    residual stream    [rows, H/x], replicated over Y            embedding, norms (sharded over X)
    q/k/v, gate/up     normal Linear: in over X, out over Y      -> this Y member's heads / columns
    o, down            transposed Linear: in over Y, out over X  -> back to [rows, H/x]

Attention modules then see only their Y member's heads. HF reshapes q/k/v with `view(..., -1, head_dim)`,
so the local head count follows from the local width; GQA keeps its query-per-kv ratio when both head
counts split over Y; only GPT-2 keeps a width attribute (`split_size`) that must be set to the local one.
Easy mode (`Architecture.easy_plan`) turns every Linear/Conv1D of any causal LM into an engine layer, but for
those its forward never calls as layers: Mamba's `dt_proj.weight @ x` reads the matrix, which the engine holds as a
flat shard, so such a layer stays whole and replicated (found by one forward on the meta device: hf/probe.py).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
from torch import nn

import parallel
from memtrain.hf.probe import KEEPS_LOGITS, meta_forward
from memtrain.hf.slots import Builder, check_divisible


@dataclass(frozen=True)
class Matrix:
    """An engine weight [rows, cols] in Linear orientation (rows = out features), at `name` in a block."""

    name: str
    rows: int
    cols: int
    transpose: bool = False
    """Sharded mode only: in-features over Y, out-features over X (easy mode builds every Linear normal)."""
    bias: bool = False
    compute_input: bool = False
    """The input is a matmul output (attention output, MLP hidden), not the residual stream."""


@dataclass(frozen=True)
class Norm:
    name: str
    hidden: int
    stats: int
    """Statistics all-reduced over X in sharded mode: 1 for RMSNorm, 2 for LayerNorm (mean, variance)."""
    bias: bool


@dataclass(frozen=True)
class Shape:
    """One transformer block (all `layers` are identical), the ends, and what attention needs."""

    family: str
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    tied: bool
    block: tuple
    final_norm: Norm
    positions: int = 0
    """Rows of a learned position table (GPT-2's wpe): a parameter without communication."""
    gated_mlp: bool = False

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token at sequence length `seq`: MFU's numerator, for the trainer's figure and the
        planner's alike. 6 x the parameters that multiply (every block's weight matrices and the LM head; not the
        input embedding, whose lookup multiplies nothing, nor norms and biases) + 12 x layers x heads x head_dim
        x seq for attention's two products, forward and backward, counted in full as PaLM's MFU counts them."""
        matmul = self.layers * sum(m.rows * m.cols for m in self.block if isinstance(m, Matrix))
        matmul += self.vocab * self.hidden
        return 6.0 * matmul + 12.0 * self.layers * self.heads * self.head_dim * seq


class Architecture:
    """Any causal LM: easy mode only, HF's initializer_range for every seeded matrix."""

    model_type: str | None = None
    layers: str = ""
    """Module path of the block list (block i is `{layers}.{i}`)."""
    embedding: str = ""
    final_norm: str = ""

    @property
    def sharded(self) -> bool:
        return self.model_type is not None

    def shape(self, config) -> Shape:
        raise ValueError(f"the planner models {', '.join(ARCHITECTURES)} architectures, not {config.model_type!r}")

    def init_std(self, config):
        """std of the seeded init per HF name."""
        std = getattr(config, "initializer_range", 0.02) or 0.02
        return lambda key: std

    def aliases(self, model, key: str) -> tuple[str, ...]:
        """Names a checkpoint may use for `key`: HF's own, and without the base-model prefix (GPT-2 hub
        files say 'h.0...' for 'transformer.h.0...')."""
        prefix = model.base_model_prefix + "."
        return (key, key[len(prefix):]) if key.startswith(prefix) else (key,)

    def plan(self, model, b: Builder, mode: str) -> None:
        (self.sharded_plan if mode == "sharded" else self.easy_plan)(model, b)

    def easy_plan(self, model, b: Builder) -> None:
        """Easy mode for any causal LM: its Linear/Conv1D layers, embedding and LM head become engine layers."""
        from transformers.pytorch_utils import Conv1D

        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
        if not isinstance(inp, nn.Embedding) or out is None:
            raise ValueError(f"{type(model).__name__}: easy mode needs an nn.Embedding input and an output embedding")
        names = {id(m): n for n, m in model.named_modules()}
        linears = [n for n, m in model.named_modules() if m is not out and isinstance(m, (nn.Linear, Conv1D))]
        seen = meta_forward(model, linears, names[id(out)])
        logits_fn, lookup_fn = _around_the_engine(model, inp, seen.around_head)
        tied = out.weight is inp.weight
        for name in linears:
            if name in seen.called:
                b.linear(name)
        emb = b.embedding(names[id(inp)])
        b.lm_head(names[id(out)], emb if tied else None).logits_fn = logits_fn
        if lookup_fn is not None:
            emb.register_forward_hook(lambda module, args, out: lookup_fn(out))

    def sharded_plan(self, model, b: Builder) -> None:
        """The block list of `shape`, applied layer by layer: one source for the plan and the planner."""
        cfg, shape = model.config, self.shape(model.config)
        self.check_sizes(shape, b.grid)
        emb = b.embedding(self.embedding)
        for i in range(shape.layers):
            prefix = f"{self.layers}.{i}"
            for part in shape.block:
                if isinstance(part, Matrix):
                    b.linear(f"{prefix}.{part.name}", transpose=part.transpose, hf_rows=self.hf_rows(part, cfg, b.grid))
                else:
                    b.norm(f"{prefix}.{part.name}")
            self.adapt_block(model.get_submodule(prefix), cfg, b.grid)
        b.norm(self.final_norm)
        b.lm_head("lm_head", emb if cfg.tie_word_embeddings else None)

    def check_sizes(self, shape: Shape, grid) -> None:
        check_divisible("num_attention_heads", shape.heads, grid, "y", "attention heads are split over Y")
        if shape.kv_heads != shape.heads:
            check_divisible("num_key_value_heads", shape.kv_heads, grid, "y", "kv heads are split over Y")
        check_divisible("hidden_size", shape.hidden, grid, "x", "the residual stream is split over X")
        check_divisible("intermediate_size", shape.intermediate, grid, "y", "MLP columns are split over Y")

    def hf_rows(self, part: Matrix, config, grid) -> torch.Tensor | None:
        """The HF row of each engine row of a weight, when a fused projection must be reordered."""
        return None

    def adapt_block(self, block: nn.Module, config, grid) -> None:
        """Set width attributes HF's block code keeps to this rank's share (most families keep none)."""


def _out_proj(name: str, rows: int, cols: int, bias: bool) -> Matrix:
    return Matrix(name, rows, cols, transpose=True, bias=bias, compute_input=True)


class Llama(Architecture):
    model_type, layers, embedding, final_norm = "llama", "model.layers", "model.embed_tokens", "model.norm"

    def shape(self, config) -> Shape:
        h, nh, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        d = getattr(config, "head_dim", None) or h // nh
        inter, ab, mb = config.intermediate_size, config.attention_bias, config.mlp_bias
        block = (Matrix("self_attn.q_proj", nh * d, h, bias=ab), Matrix("self_attn.k_proj", nkv * d, h, bias=ab),
                 Matrix("self_attn.v_proj", nkv * d, h, bias=ab), _out_proj("self_attn.o_proj", h, nh * d, ab),
                 Matrix("mlp.gate_proj", inter, h, bias=mb), Matrix("mlp.up_proj", inter, h, bias=mb),
                 _out_proj("mlp.down_proj", h, inter, mb), Norm("input_layernorm", h, 1, False),
                 Norm("post_attention_layernorm", h, 1, False))
        return Shape(self.model_type, config.vocab_size, h, nh, nkv, d, inter, config.num_hidden_layers,
                     bool(config.tie_word_embeddings), block, Norm("norm", h, 1, False), gated_mlp=True)


class GPTNeoX(Architecture):
    """Pythia. query_key_value rows are head-interleaved ([q_h, k_h, v_h] per head h, as HF's
    view(..., -1, 3*d) reads them), so a contiguous block of rows is a group of whole heads."""

    model_type, layers, embedding, final_norm = "gpt_neox", "gpt_neox.layers", "gpt_neox.embed_in", \
        "gpt_neox.final_layer_norm"

    def shape(self, config) -> Shape:  # the MLP's Linears always have a bias; attention's follow attention_bias
        h, nh, inter = config.hidden_size, config.num_attention_heads, config.intermediate_size
        ab = config.attention_bias
        block = (Matrix("attention.query_key_value", 3 * h, h, bias=ab), _out_proj("attention.dense", h, h, ab),
                 Matrix("mlp.dense_h_to_4h", inter, h, bias=True), _out_proj("mlp.dense_4h_to_h", h, inter, True),
                 Norm("input_layernorm", h, 2, True), Norm("post_attention_layernorm", h, 2, True))
        return Shape(self.model_type, config.vocab_size, h, nh, nh, h // nh, inter, config.num_hidden_layers,
                     bool(config.tie_word_embeddings), block, Norm("final_layer_norm", h, 2, True))

    def aliases(self, model, key: str) -> tuple[str, ...]:
        return super().aliases(model, key) + (("embed_out.weight",) if key == "lm_head.weight" else ())


class GPT2(Architecture):
    """Conv1D layers (HF stores them [in, out]), all with a bias; a learned position table (wpe) kept whole
    in rows and split over X; residual projections initialized at std / sqrt(2 * n_layer) as in HF."""

    model_type, layers, embedding, final_norm = "gpt2", "transformer.h", "transformer.wte", "transformer.ln_f"

    def shape(self, config) -> Shape:
        h, nh = config.n_embd, config.n_head
        inter = config.n_inner or 4 * h
        block = (Matrix("attn.c_attn", 3 * h, h, bias=True), _out_proj("attn.c_proj", h, h, True),
                 Matrix("mlp.c_fc", inter, h, bias=True), _out_proj("mlp.c_proj", h, inter, True),
                 Norm("ln_1", h, 2, True), Norm("ln_2", h, 2, True))
        return Shape(self.model_type, config.vocab_size, h, nh, nh, h // nh, inter, config.n_layer,
                     bool(config.tie_word_embeddings), block, Norm("ln_f", h, 2, True), positions=config.n_positions)

    def init_std(self, config):
        std = getattr(config, "initializer_range", 0.02) or 0.02
        scaled = std / math.sqrt(2 * config.n_layer)
        return lambda key: scaled if key.endswith("c_proj.weight") else std

    def sharded_plan(self, model, b: Builder) -> None:
        if model.config.add_cross_attention:
            raise ValueError("GPT-2 with cross-attention is not a causal LM memtrain can shard: use mode='easy'")
        self.check_sizes(self.shape(model.config), b.grid)  # before the first module is replaced
        rows, hidden = model.transformer.wpe.weight.shape
        wpe = parallel.ColumnEmbedding(rows, hidden, b.grid, device="meta", dtype=b.dtype)
        b.replace("transformer.wpe", wpe)
        b.part("transformer.wpe.weight", wpe, "weight", full_shape=(rows, hidden), axis="x", init="normal",
               std=b.std_of("transformer.wpe.weight"))
        super().sharded_plan(model, b)

    def hf_rows(self, part: Matrix, config, grid) -> torch.Tensor | None:
        return qkv_rows(config.n_embd, grid.y) if part.name == "attn.c_attn" else None

    def adapt_block(self, block: nn.Module, config, grid) -> None:
        # transformers 5.23 splits c_attn's output with `split_size` (q, k, v widths); heads follow from
        # head_dim. Both attributes become this member's share.
        block.attn.split_size, block.attn.num_heads = config.n_embd // grid.y, config.n_head // grid.y


def qkv_rows(hidden: int, y: int) -> torch.Tensor:
    """GPT-2's fused [q | k | v] rows reordered so Y member j holds [q_j | k_j | v_j] (its heads' rows)."""
    n = hidden // y
    return torch.cat([torch.arange(part * hidden + j * n, part * hidden + (j + 1) * n)
                      for j in range(y) for part in range(3)])


ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (Llama(), GPTNeoX(), GPT2())}
GENERIC = Architecture()


def architecture_of(config) -> Architecture:
    """The architecture object of a transformers config (the generic easy-mode one for unknown families)."""
    return ARCHITECTURES.get(config.model_type, GENERIC)


LOGIT_TRANSFORMS = {
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                     "granitemoeshared", "minicpm3"), ("logits_scaling", "divide")),
    "hyperclovax": ("logits_scaling", "multiply"),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), ("logit_scale", "multiply")),
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma", "nanochat"), ("final_logit_softcapping", "softcap")),
    "falcon_h1": ("lm_head_multiplier", "multiply"),
    "recurrent_gemma": ("logits_soft_cap", "softcap"),
}
"""What a *ForCausalLM.forward does to its LM head's logits, per model type, read off transformers' modeling files
(MiniCPM3 divides the hidden states instead: the same up to rounding). The same field means another operation in
another family (Granite divides by logits_scaling, HyperCLOVA X multiplies), so only these are carried."""

NEUTRAL = {"logits_scaling": 1, "logit_scale": 1, "final_logit_softcapping": None, "lm_head_multiplier": 1,
           "logits_soft_cap": None}
"""The value of each logit transform's field that leaves the logits as they are; None does too."""

OPERATIONS = {"divide": lambda x, v: x / v, "multiply": lambda x, v: x * v,
              "softcap": lambda x, v: torch.tanh(x / v) * v}

SCORE_ON_ONE_PROCESS = ("training it is not supported; score it on one process (memtrain eval --model without "
                        "torchrun), where transformers' own forward runs")


def _around_the_engine(model, embedding: nn.Embedding, around_head: list[str] | None):
    """The engine replaces the input embedding and the LM head, and its loss reads the base model's hidden states:
    what a model does around them in its own forward would be dropped. Returns what the engine's layers must do
    instead: a transform of the logits (LOGIT_TRANSFORMS) and a transform of the lookup (transformers' scaled
    embeddings: Gemma, XGLM, BioGPT, MiniCPM3 multiply it by `embed_scale`), each None where there is none. A
    transform field with another value than NEUTRAL's is refused unless its family is in LOGIT_TRANSFORMS, or is
    transformers' own and its modeling file never reads it (MPT's config holds a logit_scale its code ignores);
    so is any other op the model's forward applies between the hidden states and the logits (`around_head`, from
    the meta forward) outside the families of LOGIT_TRANSFORMS, and any other custom embedding. Where the meta
    forward tells nothing (None), a transformers family passes on its config fields alone; a model's own code is
    refused, as nothing shows what it does to its logits."""
    name, cfg = type(model).__name__, model.config
    ours = type(model).__module__.startswith("transformers.models.")
    logits_fn = None
    for key, neutral in NEUTRAL.items():
        value = getattr(cfg, key, neutral)
        if value in (None, neutral):
            continue
        field, operation = LOGIT_TRANSFORMS.get(cfg.model_type, (None, None))
        if ours and field == key:
            logits_fn = functools.partial(OPERATIONS[operation], v=value)
        elif not ours or _reads(model, key):
            raise ValueError(f"{name}: config.{key}={value!r} transforms the logits after the LM head in a way the "
                             f"engine does not know, and its vocabulary-parallel loss would skip it: "
                             f"{SCORE_ON_ONE_PROCESS}")
    unknown = [op for op in dict.fromkeys(around_head or []) if op not in KEEPS_LOGITS]
    if unknown and not (ours and cfg.model_type in LOGIT_TRANSFORMS):
        raise ValueError(f"{name}: its forward applies {', '.join(unknown)} between its hidden states and its "
                         f"logits, a transform the engine does not know, and its vocabulary-parallel loss would skip "
                         f"it: {SCORE_ON_ONE_PROCESS}")
    if around_head is None and not ours:
        raise ValueError(f"{name}: its own code does not run on the meta device (or never calls its LM head), so "
                         f"what it does to its logits cannot be seen, and the engine's loss would skip it: "
                         f"{SCORE_ON_ONE_PROCESS}")
    kind = type(embedding)
    if kind.forward is nn.Embedding.forward:
        return logits_fn, None
    scale = getattr(embedding, "scalar_embed_scale", getattr(embedding, "embed_scale", None))
    if not (kind.__module__.startswith("transformers.models.") and kind.__name__.endswith("ScaledWordEmbedding")
            and isinstance(scale, (int, float))):
        raise ValueError(f"{name}: its input embedding {kind.__name__} changes the lookup in its own forward, which "
                         f"the engine's embedding would drop: {SCORE_ON_ONE_PROCESS}")
    if isinstance(embedding.embed_scale, torch.Tensor):  # Gemma: a float32 buffer cast to the table's dtype
        return logits_fn, lambda out: out * torch.tensor(scale, dtype=torch.float32).to(out.dtype)
    return logits_fn, lambda out: out * scale


def _reads(model, key: str) -> bool:
    """Whether the file that defines the model's class mentions config field `key` (True where it cannot be read:
    refused rather than guessed)."""
    try:
        return key in inspect.getsource(inspect.getmodule(type(model)))
    except (OSError, TypeError):
        return True
