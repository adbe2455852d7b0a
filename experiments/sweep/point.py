"""A sweep point's life, written once for every launcher: resolve its base model, point model.init at it, claim
its run directory, build its command; and when the run has ended, make its record, append it to results.jsonl and
say so. The local loop (run.py) runs the command here; the cluster path (slurm.py) runs it as a job and makes
the record when the job ends, possibly in a later sweep (`--resume` collects it).

    life = PointLife(spec, out, prefix, bases, resume, log)     # one per sweep
    launch = life.prepare(p)            # None: its base model failed, and its failed record is appended already
    rc, err = run_fn(launch.command, launch.run_dir)
    life.finish(life.ended(launch, "ok" if rc == 0 else "failed", err))

A run directory belongs to its point: a claim clears what an interrupted or older run of the point left there,
unless the run can resume from a checkpoint of the very same config (`--resume`). Any other run found there (one
`memtrain train` wrote, or another sweep's) is refused, never removed, and a claim holds the lock a trainer holds
while it writes the directory, so a live trainer's files are never cleared under it.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.results import RESULTS, make_record, now
from memtrain.config import RunConfig, load_toml, to_toml
from memtrain.files import append_jsonl, file_lock, write_atomic
from memtrain.run_files import CHECKPOINTS, CONFIG, EVAL, EVAL_CANARIES, LATEST, LOCK, is_run

from .base_models import BaseModelError, BaseModels
from .launch import train_tail
from .spec import Point, Spec


@dataclass
class Launch:
    """A point ready to run: its command, and what its record needs once the run has ended."""

    point: Point
    run_dir: Path
    base_dir: Path | None
    command: list[str]
    resumed: bool
    """A checkpoint of this config lets the run continue (the command ends with --resume)."""
    started: str
    t0: float


class PointLife:
    """What the points of one sweep share: the spec, the sweep directory, the command prefix, the base models,
    --resume, and the results file with the ids of the points that failed (threads finish points side by side)."""

    def __init__(self, spec: Spec, out: Path, prefix: list[str], bases: BaseModels, resume: bool, log=print):
        self.spec = spec
        self.out = out
        self.prefix = prefix
        self.bases = bases
        self.resume = resume
        self.log = log
        self.results = out / RESULTS
        self.failed: list[str] = []
        self._lock = threading.Lock()

    def prepare(self, p: Point) -> Launch | None:
        """Base model, model.init, run directory and command of `p`; None if its base model could not be built
        (the point is then recorded as failed, with the base's error, and the sweep goes on)."""
        run_dir = self.out / p.id
        started, t0 = now(), time.time()
        base_dir = None
        if self.spec.pretrain.applies_to(p.cfg):
            try:
                base_dir = self.bases.get(p.cfg)
            except BaseModelError as e:
                with _held(run_dir, p.cfg):
                    _clear(run_dir)  # no stale files of an older run in this record
                self.finish(self.record(p, run_dir, None, "failed", str(e), started, time.time() - t0))
                return None
            p.cfg.model.init = str(base_dir)
            if p.cfg.canaries.unique_against is None and "document" in p.cfg.canaries.kinds:
                # a canary or twin the base model read in pretraining would not test memorization of the pass
                p.cfg.canaries.unique_against = self.bases.pretraining_corpus(p.cfg)
        started, t0 = now(), time.time()  # the run's own time, without building its base model
        resumed = claim_run_dir(run_dir, p.cfg, self.resume)
        return Launch(p, run_dir, base_dir, self.prefix + train_tail(run_dir, resumed), resumed, started, t0)

    def record(self, p: Point, run_dir: Path, base_dir: Path | None, status: str, error: str | None, started: str,
               seconds: float) -> dict:
        return make_record(self.spec.name, p, run_dir, base_dir, status, error, started, seconds)

    def ended(self, launch: Launch, status: str, error: str | None) -> dict:
        """The record of a launch that ended here, timed from its start."""
        return self.record(launch.point, launch.run_dir, launch.base_dir, status, error, launch.started,
                           time.time() - launch.t0)

    def finish(self, record: dict) -> None:
        """Append a finished run's record (as it ends: the results file is the sweep's progress) and say so."""
        pid, run_dir = record["point"], Path(record["run_dir"])
        with self._lock:
            append_jsonl(self.results, record)
            if record["status"] != "ok":
                if pid not in self.failed:  # a cluster job collected failed, submitted again and failed again
                    self.failed.append(pid)
            elif pid in self.failed:  # failed, then collected again and ok (cluster sweeps)
                self.failed.remove(pid)
        if record["status"] == "ok":
            if not self.spec.keep_checkpoints:
                self._drop_checkpoints(run_dir, record["params"])
            ev = record["eval"] or {}
            self.log(f"{pid}: ok in {record['seconds']:.0f}s  params={_num(record['params'])}  "
                     f"exact={_num(ev.get('exact_match_rate'))}  rougeL={_num(ev.get('rougeL'))}  "
                     f"mia_auc={_num(ev.get('mia_auc_loss'))}  val_loss={_num(ev.get('val_loss'))}")
        else:
            where = "" if "[log:" in (record["error"] or "") else f"  [logs: {run_dir}]"
            self.log(f"{pid}: FAILED after {record['seconds']:.0f}s: {record['error']}{where}")

    def _drop_checkpoints(self, run_dir: Path, params: int | None) -> None:
        """An evaluated run's checkpoints, deleted as keep_checkpoints = false asks: all of them, or all but the
        final weights (spec.keep_final_weights) that `memtrain export` and `memtrain eval` read."""
        if not self.spec.keeps_final_weights(params):
            shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)
            return
        from memtrain.training import checkpoint  # the trainer's modules: only once a run has ended

        try:
            checkpoint.keep_final_weights(run_dir)
        except (OSError, ValueError) as e:  # the result is recorded: a checkpoint left whole costs only disk
            self.log(f"warning: {run_dir}: its checkpoints were kept whole ({e})")


def claim_run_dir(run_dir: Path, cfg: RunConfig, resume: bool) -> bool:
    """Write the run's config.toml; True if a checkpoint of this exact config lets the run resume."""
    text = to_toml(cfg)
    with _held(run_dir, cfg):
        same = (run_dir / CONFIG).is_file() and (run_dir / CONFIG).read_text() == text
        if resume and same and (run_dir / CHECKPOINTS / LATEST).is_file():
            for name in (EVAL, EVAL_CANARIES):  # the evaluation runs again after the resumed training
                (run_dir / name).unlink(missing_ok=True)
            return True
        _clear(run_dir)  # leftovers of an interrupted or older run of this point
        write_atomic(run_dir / CONFIG, text)
    return False


def check_point_dir(run_dir: Path, cfg: RunConfig) -> None:
    """Refuse a run in `run_dir` that is not an earlier run of this point: only a directory holding no run, or one
    whose config.toml names this sweep and point (wandb.group and wandb.name, which the sweep sets), is cleared."""
    if not is_run(run_dir):
        return
    try:
        wb = load_toml(run_dir / CONFIG).get("wandb")
    except (ValueError, OSError):  # unreadable: not provably this point's
        wb = None
    if not isinstance(wb, dict) or (wb.get("group"), wb.get("name")) != (cfg.wandb.group, cfg.wandb.name):
        raise FileExistsError(f"{str(run_dir)!r} holds a training run this sweep did not make: move it elsewhere, "
                              "or give the sweep another --out")


@contextlib.contextmanager
def _held(run_dir: Path, cfg: RunConfig):
    """`run_dir` (created if missing) under a trainer's lock, once check_point_dir has passed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(file_lock(run_dir / LOCK, blocking=False))
        except BlockingIOError:
            raise FileExistsError(f"a trainer is writing {str(run_dir)!r}: let it end (or stop it) before the sweep "
                                  "runs this point again") from None
        check_point_dir(run_dir, cfg)
        yield


def _clear(run_dir: Path) -> None:
    """Remove everything in `run_dir` but its lock (held: removing it would let a trainer lock a new one)."""
    for entry in run_dir.iterdir():
        if entry.name != LOCK:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v / 1e6:.2f}M"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
