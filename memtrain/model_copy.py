"""A run's copy of the model directory it trained from (`memtrain train --set model.name=DIR`).

A run from a named model rebuilds it from memtrain's configs; one from a directory would otherwise rebuild it from
DIR at every `memtrain eval` and `export`, and an edited config.json (another activation, rope_theta) or a deleted
DIR would change or break what the run's checkpoints are scored and exported as. The trainer keeps DIR's
config.json and the code files its auto_map names in RUN/model_dir (run_files.MODEL_DIR) with a note of whether DIR
held weights (the vocabulary rule of models.build_model); export, eval and resume build from that copy.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_imports

from memtrain.files import atomic_dir
from memtrain.models import MODELS, holds_weights
from memtrain.run_files import MODEL_DIR, MODEL_SOURCE


def run_model_name(run: str | os.PathLike, name: str) -> str:
    """What to build run `run`'s model from: its copy of the model directory it trained from (keep_model_dir),
    so that the directory edited or deleted since changes nothing; else `name`, its model.name (a named model,
    a hub id, or a run from before runs kept the copy, which still needs its directory)."""
    kept = Path(run) / MODEL_DIR
    if (kept / "config.json").is_file():
        return str(kept)
    hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if name not in MODELS and not hub_id and not os.path.isdir(name):  # else "unknown model": a typo, it seems
        raise FileNotFoundError(f"the run's model directory {name!r} (model.name) no longer exists, and the run "
                                f"({str(run)!r}, made before runs kept a copy of it) is built from it: restore the "
                                "directory at that path")
    return name


def keep_model_dir(name: str, run: str | os.PathLike) -> None:
    """Copy model directory `name`'s config.json and code files (code_files) into run/MODEL_DIR, with
    MODEL_SOURCE: export and eval build the run's model from that copy (run_model_name), so a run stays what it
    trained when the directory is edited or deleted. Nothing for a named model or a hub id."""
    if name in MODELS or not os.path.isdir(name):
        return
    src = Path(name)
    raw = (src / "config.json").read_bytes()
    config = json.loads(raw)
    with atomic_dir(Path(run) / MODEL_DIR) as tmp:
        auto_map, files = config.get("auto_map"), _copy_code(src, tmp)
        local = _local_auto_map(auto_map, files) if isinstance(auto_map, dict) else auto_map
        if local != auto_map:  # else byte for byte
            raw = (json.dumps(dict(config, auto_map=local), indent=2) + "\n").encode()
        (tmp / "config.json").write_bytes(raw)
        (tmp / MODEL_SOURCE).write_text(json.dumps({"model.name": str(src.resolve()),
                                                    "weights": holds_weights(src)}) + "\n")


def _auto_map_refs(path: Path) -> list[str]:
    """Every class reference the auto_map of `path`'s config.json (config, model and tokenizer classes) and
    tokenizer_config.json (the tokenizer's, a dict or the legacy [slow, fast] list) names."""
    refs = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((path / name).read_text(encoding="utf-8")).get("auto_map")
        except (OSError, ValueError, AttributeError):  # absent, or not a JSON object: it names no code
            continue
        values = auto_map.values() if isinstance(auto_map, dict) else auto_map if isinstance(auto_map, list) else ()
        for value in values:  # a tokenizer's: [slow, fast], either may be null
            refs += [r for r in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(r, str)]
    return [r for r in refs if "." in r]


def _module_file(ref: str) -> str:  # of 'module.Class' or 'owner/repo--module.Class'
    return ref.split("--")[-1].rsplit(".", 1)[0] + ".py"


def code_files(path: str | os.PathLike) -> list[Path]:
    """The Python files of model directory `path` its auto_map names and those they import relatively, found as
    transformers finds them (read, never imported); one it lacks is left out ('repo--' code may be the repo's)."""
    path = Path(path)
    todo, found = [_module_file(r) for r in _auto_map_refs(path)], []
    while todo:
        name = todo.pop()  # a file beside config.json, as transformers looks it up: never a path out of `path`
        if os.path.basename(name) != name or name.startswith(".") or path / name in found:
            continue
        if (path / name).is_file():
            found.append(path / name)
            todo += [f"{m}.py" for m in get_relative_imports(path / name)]
    return found


def save_code(name: str, config, dest: Path) -> None:
    """Copy directory `name`'s code files into `dest`, config.auto_map made local to them: from_pretrained(dest,
    trust_remote_code=True) needs them all (config.save_pretrained copies the config class's file alone)."""
    if name in MODELS or not os.path.isdir(name):
        return
    files = _copy_code(Path(name), dest)
    if isinstance(getattr(config, "auto_map", None), dict):
        config.auto_map = _local_auto_map(config.auto_map, files)


def _copy_code(src: Path, dest: Path) -> list[Path]:
    files = code_files(src)
    for file in files:
        shutil.copyfile(file, dest / file.name)
    return files


def _local_auto_map(auto_map: dict, files: list[Path]) -> dict:
    """`auto_map` with each 'owner/repo--module.Class' whose module is among `files` (copied beside it) as
    'module.Class': the copy then loads its own code, offline, not that repository's."""
    names = {f.name for f in files}

    def local(ref):
        return ref.split("--")[-1] if isinstance(ref, str) and "--" in ref and _module_file(ref) in names else ref

    return {k: [local(r) for r in v] if isinstance(v, (list, tuple)) else local(v) for k, v in auto_map.items()}
