"""`checkpoint.keep_final_weights`: a finished run trimmed to the model files of the checkpoint `latest` names."""

from __future__ import annotations

from memtrain.training import checkpoint


def _checkpoint(root, step: int) -> None:
    path = root / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    for name in ("model-00000", "model-00001", "optimizer-00000", "optimizer-00001"):
        (path / f"{name}.safetensors").write_bytes(b"pieces")
    (path / "state.json").write_text(f'{{"step": {step}}}')


def test_only_the_final_weights_stay(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / "checkpoints" / "latest").write_text("step_000006")
    kept = checkpoint.keep_final_weights(tmp_path)
    assert kept == tmp_path / "checkpoints" / "step_000006" == checkpoint.latest(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000006"]
    assert sorted(p.name for p in kept.iterdir()) == ["model-00000.safetensors", "model-00001.safetensors",
                                                       "state.json"]
    # a resume would start fresh moments: refused, naming what is missing
    assert checkpoint.missing_optimizer(kept) == ["optimizer-00000.safetensors", "optimizer-00001.safetensors"]
    assert checkpoint.keep_final_weights(tmp_path) == kept  # again: nothing more to drop


def test_a_run_without_a_checkpoint_is_left_alone(tmp_path):
    assert checkpoint.keep_final_weights(tmp_path) is None
    assert not (tmp_path / "checkpoints").exists()
