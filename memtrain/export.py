"""`memtrain export RUN_OR_CHECKPOINT --out DIR`: a trained run as a plain transformers model directory.

Why: a memorization result should be checkable without memtrain. The directory loads with transformers
alone, offline and without remote code,

    model = AutoModelForCausalLM.from_pretrained(DIR, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(DIR, local_files_only=True)

and greedy `model.generate` from memtrain's context gives memtrain's extraction of every canary back. That
context is the EOS that opens each canary in training, then the canary's prefix: with document attention
(the default) exactly what training saw, wherever the copy sat in its row. Every training document starts
after an EOS, so EOS is also the exported BOS (`tok(text)` starts with it) and, where the tokenizer has no
pad token, the pad. Pass generate an explicit attention mask (ones, or a batch's padding mask): with pad
equal to EOS it cannot infer one, the opening EOS looking like padding.

What: RUN_OR_CHECKPOINT is a run directory of `memtrain train` (its newest complete checkpoint) or one of
its checkpoint directories. DIR gets config.json (the model config as the trainer built it),
model.safetensors (the checkpoint's full tensors under HF names, read and written with safetensors only; written
one tensor group at a time, in HF's model-0000i-of-0000n files with an index when over 5 GiB),
generation_config.json (greedy), the run's tokenizer and, for a model with its own code (--trust-remote-code),
every code file its auto_map names (it then loads with trust_remote_code=True). It is written into a temporary
sibling and renamed into place, so DIR never holds a half-written model.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from pathlib import Path

from safetensors.torch import save_file
from transformers import AutoTokenizer, GenerationConfig

from memtrain.config import load as load_config
from memtrain.data.tokenizer import vocab_size
from memtrain.files import atomic_dir, read_json
from memtrain.hf.parallelize import hf_keys
from memtrain.model_copy import run_model_name, save_code
from memtrain.models import allow_remote_code, build_model
from memtrain.run_files import CONFIG, EVAL, RUN, TOKENIZER, check_output
from memtrain.training.checkpoint import latest, model_source

_HINT = "pass the --out directory of `memtrain train` or one of its checkpoints/step_* directories"
_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
"""The weight files an export writes, in one file or in shards."""


def export(source: str | os.PathLike, out: str | os.PathLike, max_shard_bytes: int = 5 * 2**30,
           trust_remote_code: bool = False) -> tuple[Path, Path]:
    """Write the model of a run or checkpoint to `out` (never inside a run directory); returns (the checkpoint
    exported, out). The run's own config never allows remote code: only `trust_remote_code` (the command's flag)."""
    out = check_output(out).resolve()  # a link's target is replaced, never the link itself
    run, ckpt = resolve(Path(source))
    cfg = load_config(run / CONFIG)
    allow_remote_code(cfg, trust_remote_code, str(run / CONFIG))
    tok = run_tokenizer(run, cfg)
    # The model the trainer built (named config at the tokenizer's vocabulary, or the directory's config as the
    # run kept it), on meta: only its config and its state-dict names and shapes are needed.
    built = run_model_name(run, cfg.model.name)
    model = build_model(built, vocab_size=vocab_size(tok), device="meta", trust_remote_code=cfg.model.trust_remote_code)
    src, keys = _open_checked(ckpt, model, cfg.model.name)

    config = model.config
    config.architectures = [type(model).__name__]
    # The tokenizer's ids, not the config's defaults (LlamaConfig's BOS 1 and EOS 2 mean nothing to a local BPE).
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config.update(ids)
    generation = GenerationConfig(do_sample=False, **ids)

    with src, atomic_dir(out) as tmp:
        config.dtype = src.dtype(keys[0])  # from_pretrained loads the weights as they are
        _write_weights(src, keys, tmp, max_shard_bytes)
        # A model with its own code loads only beside every file its auto_map names: those the run trained with
        save_code(built, config, tmp)
        config.save_pretrained(tmp)
        # safetensors creates its files owner-only (0600): give them the mode of the files beside them.
        for f in tmp.glob("*.safetensors"):
            os.chmod(f, (tmp / "config.json").stat().st_mode)
        generation.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # Only an earlier export is replaced (its weights perhaps in other shards): any other file in `out` would
        # be deleted along with it.
        written = set(os.listdir(tmp))
        foreign = sorted(f for f in os.listdir(out) if f not in written and not _WEIGHTS.fullmatch(f)) \
            if out.is_dir() else []
        if foreign:
            raise FileExistsError(f"--out {str(out)!r} holds files an export does not write ({', '.join(foreign[:3])})"
                                  ": name a new or empty directory")
    return ckpt, out


def resolve(path: Path, then: str = "export") -> tuple[Path, Path]:
    """(run directory, checkpoint directory) of a run directory or of one of its checkpoints; `then` is what the
    caller does with it, for the fix a run without weights is given."""
    path = path.resolve()  # a checkpoint named from inside its run (step_000002) has the run two levels up
    if not path.exists():
        raise FileNotFoundError(f"RUN_OR_CHECKPOINT {str(path)!r} does not exist: {_HINT}")
    if (path / CONFIG).is_file():
        ckpt = latest(path)
        if ckpt is None and (path / EVAL).is_file():  # evaluated, then a sweep deleted its weights
            # The run's own config.toml is what the sweep trained it with (model.init at its cached base model):
            # `train` of it into a new directory is the point's run again, and keeps its checkpoints.
            again = path.with_name(path.name + "-weights")
            raise FileNotFoundError(f"run {str(path)!r} finished but its weights were deleted once it was evaluated "
                                    "(a sweep's keep_final_weights dropped them): retrain it with `memtrain train "
                                    f"--config {shlex.quote(str(path / CONFIG))} --out {shlex.quote(str(again))}` "
                                    f"and {then} that directory")
        if ckpt is None:
            raise FileNotFoundError(f"run {str(path)!r} has no complete checkpoint in {str(path / 'checkpoints')!r}: "
                                    "let its training finish (`memtrain train --resume` continues from a saved "
                                    "checkpoint; a run stopped before its first save starts again with --force)")
        return path, ckpt
    run = path.parent.parent  # RUN/checkpoints/step_N: the config and tokenizer live in RUN
    if (path / "state.json").is_file() and (run / CONFIG).is_file():
        return run, path
    raise ValueError(f"RUN_OR_CHECKPOINT {str(path)!r} is neither a run directory (config.toml) nor a checkpoint "
                     f"of one (state.json): {_HINT}")


def run_tokenizer(run: Path, cfg):
    """The run's tokenizer with BOS = EOS (prepended by the tokenizer) and a pad token."""
    if (run / TOKENIZER).is_dir():
        try:  # never its code: a tokenizer_config.json with auto_map is a run directory's way to run Python
            tok = AutoTokenizer.from_pretrained(run / TOKENIZER, local_files_only=True, trust_remote_code=False)
        except ValueError as e:
            raise ValueError(f"the run's tokenizer {str(run / TOKENIZER)!r} does not load ({str(e).splitlines()[0]})"
                             ": export a run as `memtrain train` wrote it") from None
        for key in ("is_local", "local_files_only"):  # how this copy was loaded, which save_pretrained would keep
            tok.init_kwargs.pop(key, None)
    else:  # a run from before the trainer kept its tokenizer: rebuild the stream, check it is the trained one
        from memtrain.data import build_stream

        stream = build_stream(cfg.data, cfg.canaries, seed=cfg.train.seed, batch_size=cfg.train.batch_size)
        info = read_json(run / RUN, "run file", "restore it from a copy of the run, or export another run")
        if info.get("stream_key") != stream.key:
            raise ValueError(f"run {str(run)!r} has no tokenizer/ and its data or tokenizer changed since training: "
                             "export with the data and tokenizer it was trained with")
        tok = stream.tokenizer
    tok.bos_token = tok.eos_token
    tok.add_bos_token = True
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _open_checked(ckpt: Path, model, name: str):
    """The checkpoint's tensors (opened lazily), checked against the model's state-dict names and shapes (tied
    copies aside)."""
    src = model_source(ckpt)
    keys, _ = hf_keys(model)
    shapes = model.state_dict()
    wrong = sorted(set(keys) ^ set(src.keys())) or [k for k in keys if src.shape(k) != tuple(shapes[k].shape)]
    if wrong:
        src.close()
        raise ValueError(f"checkpoint {str(ckpt)!r} does not fit model {name!r} ({', '.join(wrong[:3])}): export "
                         "with the config it was trained with")
    return src, keys


def _write_weights(src, keys: list[str], out: Path, max_shard_bytes: int) -> None:
    """HF's layout: model.safetensors, or model-0000i-of-0000n.safetensors files of at most `max_shard_bytes`
    with model.safetensors.index.json. One file's tensors are in memory at a time, never the whole model."""
    sizes = {k: math.prod(src.shape(k)) * src.dtype(k).itemsize for k in keys}
    groups, size = [[]], 0
    for k in keys:
        if groups[-1] and size + sizes[k] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += sizes[k]
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    for name, group in zip(names, groups):
        tensors = {k: src.read(k).contiguous() for k in group}
        save_file(tensors, str(out / name), metadata={"format": "pt"})  # format=pt as save_pretrained writes it
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: name for name, group in zip(names, groups) for k in group}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
