"""What checkpoints leave on disk: files as readable as the umask says (safetensors alone would leave them 0600),
only the newest `keep` of them, and after a failed write nothing half-written where a resume reads."""

import errno
import os
import resource
import signal
import stat

import pytest
import torch

import parallel
from memtrain.hf import parallelize
from memtrain.training import checkpoint
from parallel.forked import run_ranks
from tests.memtrain._models import tiny


class _Schedule:
    def state_dict(self) -> dict:
        return {}


def _model():
    plm = parallelize(tiny("llama", device="meta"), parallel.Grid(1, 1, 1, 1), seed=0)
    opt = torch.optim.AdamW(plm.parameters())
    for p in parallel.unique_parameters(plm):
        opt.state[p].update(exp_avg=p.detach() * 2, exp_avg_sq=p.detach() ** 2, step=torch.tensor(1.0))
    return plm, opt


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_checkpoint_files_have_the_mode_the_umask_gives(tmp_path, umask):
    plm, opt = _model()
    old = os.umask(umask)
    try:
        checkpoint.save(tmp_path, plm, opt, _Schedule(), 1, {})
    finally:
        os.umask(old)
    root = tmp_path / "checkpoints"
    files = [*(root / "step_000001").iterdir(), root / "latest"]
    assert {f.name for f in files} == {"model-00000.safetensors", "optimizer-00000.safetensors", "state.json",
                                       "latest"}
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: oct(0o666 & ~umask)
                                                                             for f in files}


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    plm, opt = _model()
    root = tmp_path / "checkpoints"
    later = root / "step_000009"  # after the steps saved here: a resume refuses to overwrite it, pruning leaves it
    later.mkdir(parents=True)
    for step in range(1, 6):
        checkpoint.save(tmp_path, plm, opt, _Schedule(), step, {}, keep=2)
        names = sorted(p.name for p in root.iterdir())
        assert names == ["latest", *[f"step_{s:06d}" for s in range(max(1, step - 1), step + 1)], "step_000009"]
        assert (root / "latest").read_text() == f"step_{step:06d}"
    checkpoint.save(tmp_path, plm, opt, _Schedule(), 6, {}, keep=0)  # 0: every one kept
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000004", "step_000005", "step_000006", "step_000009"]
    checkpoint.save(tmp_path, plm, opt, _Schedule(), 7, {}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000007", "step_000009"]
    assert checkpoint.latest(tmp_path) == root / "step_000007"


def _save_past_a_file_size_limit(rank, world, run):
    """Step 1 saved, then step 2 under a file size limit below the model file's size: safetensors' real write
    fails (EFBIG, the kernel's own error, as ENOSPC is on a full disk)."""
    plm, opt = _model()
    checkpoint.save(run, plm, opt, _Schedule(), 1, {})
    limit = (run / "checkpoints" / "step_000001" / "model-00000.safetensors").stat().st_size // 2
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        checkpoint.save(run, plm, opt, _Schedule(), 2, {})
    except OSError as e:
        return e.errno, e.filename, e.strerror
    return None


def test_a_failed_write_is_an_os_error_naming_the_file_and_leaves_the_previous_checkpoint(tmp_path):
    code, filename, why = run_ranks(1, _save_past_a_file_size_limit, tmp_path)[0]
    assert code == errno.EFBIG and filename.endswith("model-00000.safetensors")
    assert why.startswith(os.strerror(errno.EFBIG)) and "step 2 was not saved" in why
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no temporary, no step 2
    assert checkpoint.latest(tmp_path) == root / "step_000001"
