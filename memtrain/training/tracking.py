"""Weights & Biases tracking for training runs, on global rank 0 only, never able to fail a run.

    tracker = Tracker.start(cfg, run_dir, rank)       # a no-op tracker off rank 0 or when disabled
    tracker.log(record, step)                         # one metrics.jsonl record
    tracker.log_eval(summary, rows)                   # eval.json summary + per-canary wandb.Table
    tracker.log_images([Path("figures/x.png")])
    tracker.finish()

One W&B run per training run: project = cfg.wandb.project, group = cfg.wandb.group (the sweep name),
job_type "train", name = cfg.wandb.name or the run directory's name, config = the full resolved config,
dir = the run directory (offline files land in RUN_DIR/wandb/offline-run-*, upload later with `wandb sync`;
`sync_all` makes one command for many runs). The per-pass probe's records (train/pass/*) plot against their
pass number (PASS_AXIS), not the optimizer step.

Mode (cfg.wandb.mode):
- 'online' / 'offline' / 'disabled' as W&B defines them;
- 'auto': WANDB_MODE when set, else 'disabled' when WANDB_DISABLED is true, else 'online' when
  credentials exist (WANDB_API_KEY, or a netrc entry for the W&B host: only its presence is checked)
  AND the host answers a TCP connect within a short timeout, else 'offline'.

The local JSONL files written by the trainer stay the record of truth: W&B is a mirror. Any exception
raised by wandb (import, init, log, finish) is caught, reported once as a warning, and the tracker
turns into a no-op for the rest of the run. Nothing here reads a secret's value or writes one: the
config logged is the run's RunConfig, with secret-looking keys redacted as a safety net.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import socket
import sys
import warnings
from pathlib import Path
from urllib.parse import urlparse

from memtrain.config import WANDB_MODES
from memtrain.files import write_atomic
from memtrain.progress import note
from memtrain.run_files import WANDB_RUN
from memtrain.secrets import redact

_TRUE = ("1", "true", "yes", "on")
DEFAULT_HOST = "https://api.wandb.ai"
PASS_AXIS = "train/pass/pass"
"""The pass number of the probe's records: the trainer logs {"pass": scores} after every pass, which `log` flattens
under train/pass/, and W&B draws train/pass/* against this key (define_metric) instead of the step."""
OFFLINE_RUNS = "wandb/offline-run-*"
"""Where an offline run of `Tracker.start(cfg, run_dir)` lands, under run_dir (wandb's own layout for dir=)."""


def _host_url() -> str:
    return os.environ.get("WANDB_BASE_URL") or DEFAULT_HOST


def has_credentials() -> bool:
    """True if an API key is available to wandb: WANDB_API_KEY or a netrc entry for the W&B host.

    Only the presence of an entry is checked; the key itself is never read into our code paths."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(_host_url()).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    if not os.path.isfile(path):
        return False
    try:
        import netrc

        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def network_reachable(timeout: float = 1.5) -> bool:
    """A cheap check: can we open a TCP connection to the W&B host within `timeout` seconds?"""
    url = urlparse(_host_url())
    host = url.hostname or "api.wandb.ai"
    port = url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_mode(mode: str | None) -> str:
    """The concrete W&B mode ('online', 'offline' or 'disabled') for a configured mode."""
    mode = (mode or "auto").lower()
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb.mode={mode!r} is invalid: use one of {list(WANDB_MODES)}")
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE", "").lower()
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    if os.environ.get("WANDB_DISABLED", "").lower() in _TRUE:
        return "disabled"
    if has_credentials() and network_reachable():
        return "online"
    return "offline"


def _scalar(v):
    """A value wandb.log accepts as a number, or None (dicts, strings and NaN-free None are dropped)."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v if not (isinstance(v, float) and math.isinf(v)) else None
    return None


def flatten(d: dict, prefix: str = "", sep: str = "/") -> dict:
    """Nested dict -> flat {'a/b': number} with only numeric leaves (what charts and summaries use)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key, sep))
        else:
            s = _scalar(v)
            if s is not None:
                out[key] = s
    return out


class Tracker:
    """A W&B run mirror. Every method is safe to call on any rank and in any mode."""

    def __init__(self, run=None, mode: str = "disabled", wandb_module=None):
        self._run = run
        self._wandb = wandb_module
        self.mode = mode if run is not None else "disabled"
        self._warned = False
        self._last_step = 0
        self._offline_dir = self.run_dir if self.mode == "offline" else None
        """Where this offline run's files are, named once by `finish` with the command that uploads them."""

    # construction -------------------------------------------------------------------------------
    @classmethod
    def noop(cls) -> Tracker:
        return cls()

    @classmethod
    def start(cls, cfg, run_dir: str | Path, rank: int = 0, *, job_type: str = "train",
              name: str | None = None, config: dict | None = None) -> Tracker:
        """Start the W&B run of a training run (global rank 0), or a no-op tracker. `config` replaces the run's
        config as the W&B run's config (a sweep's report run logs the sweep spec)."""
        if rank != 0:
            return cls.noop()
        try:
            mode = resolve_mode(getattr(cfg.wandb, "mode", "auto"))
        except ValueError as e:
            warnings.warn(f"W&B disabled: {e}", stacklevel=2)
            return cls.noop()
        if mode == "disabled":
            return cls.noop()
        run_dir = Path(run_dir)
        try:
            import wandb

            run_dir.mkdir(parents=True, exist_ok=True)
            saved = _read_state(run_dir)
            run_id = saved.get("id") if saved.get("project") == cfg.wandb.project else None
            kwargs = dict(project=cfg.wandb.project, group=cfg.wandb.group, job_type=job_type,
                          name=name or cfg.wandb.name or run_dir.resolve().name,
                          config=redact(cfg.to_dict() if config is None else config), dir=str(run_dir), mode=mode,
                          settings=_settings(wandb))
            if run_id:
                kwargs.update(id=run_id, resume="allow")
            run = wandb.init(**kwargs)
            if job_type == "train":  # the probe's records, against their pass (a resumed run too)
                run.define_metric(PASS_AXIS)
                run.define_metric("train/pass/*", step_metric=PASS_AXIS)
            _write_state(run_dir, {"id": run.id, "project": cfg.wandb.project, "mode": mode})
            return cls(run, mode, wandb)
        except Exception as e:  # noqa: BLE001 - tracking must never fail a run
            warnings.warn(f"W&B tracking disabled for this run ({type(e).__name__}: {e}); the local "
                          "JSONL files are unaffected", stacklevel=2)
            return cls.noop()

    # logging ------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._run is not None

    @property
    def run_dir(self) -> Path | None:
        """Where W&B keeps this run's files (offline: upload with `wandb sync <dir>`)."""
        if self._run is None:
            return None
        try:
            return Path(self._run.dir).parent
        except Exception:  # noqa: BLE001
            return None

    def _fail(self, what: str, e: BaseException) -> None:
        if not self._warned:
            warnings.warn(f"W&B {what} failed ({type(e).__name__}: {e}); tracking is off for the rest of "
                          "this run, the local JSONL files are unaffected", stacklevel=3)
            self._warned = True
        run, self._run = self._run, None
        self.mode = "disabled"
        try:
            if run is not None:
                run.finish(exit_code=1)
        except Exception:  # noqa: BLE001
            pass

    def log(self, record: dict, step: int) -> None:
        """Log a metrics record (numeric values; nested dicts flattened as 'a/b') at a training step."""
        if self._run is None:
            return
        try:
            data = {f"train/{k}": v for k, v in flatten(record).items() if k != "step"}
            self._last_step = max(self._last_step, int(step))
            self._run.log(data, step=int(step))
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def log_eval(self, summary: dict, rows: list[dict]) -> None:
        """Log the eval summary (eval.json) as eval/* summary values and the per-canary rows as a Table."""
        if self._run is None:
            return
        try:
            flat = {f"eval/{k}": v for k, v in flatten(summary).items()}
            for k, v in flat.items():
                self._run.summary[k] = v
            data = dict(flat)
            if rows:
                data["eval/canaries"] = self._table(rows)
            self._run.log(data, step=self._last_step)
        except Exception as e:  # noqa: BLE001
            self._fail("log_eval", e)

    def _table(self, rows: list[dict]):
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns]
        data = [[_cell(r.get(c)) for c in columns] for r in rows]
        return self._wandb.Table(columns=columns, data=data)

    def log_images(self, paths: list[Path], prefix: str = "figures") -> None:
        """Log PNG figures as wandb.Image under figures/<file stem>."""
        if self._run is None:
            return
        try:
            images = {f"{prefix}/{Path(p).stem}": self._wandb.Image(str(p)) for p in paths if Path(p).is_file()}
            if images:
                self._run.log(images, step=self._last_step)
        except Exception as e:  # noqa: BLE001
            self._fail("log_images", e)

    def log_table(self, key: str, rows: list[dict]) -> None:
        """Log any list of flat dicts as a wandb.Table (e.g. a sweep's results)."""
        if self._run is None or not rows:
            return
        try:
            self._run.log({key: self._table(rows)}, step=self._last_step)
        except Exception as e:  # noqa: BLE001
            self._fail("log_table", e)

    def finish(self, exit_code: int = 0, *, say_sync: bool = True) -> None:
        """End the W&B run; an offline one names its directory and the command that uploads it, unless `say_sync`
        is false (a caller that prints one command for many runs: `sync_all`)."""
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            if not self._warned:
                warnings.warn(f"W&B finish failed ({type(e).__name__}: {e})", stacklevel=2)
                self._warned = True
            return
        if self._offline_dir is not None and say_sync:
            path = shlex.quote(str(self._offline_dir))
            note(f"W&B: offline run saved in {path}; upload it with: {sync_command()} sync {path}")
            self._offline_dir = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.finish(exit_code=1 if exc_type else 0)
        return False


def sync_command() -> str:
    """How to call the wandb CLI of this environment: `wandb` when that is the one on PATH, else its path."""
    beside = Path(sys.executable).with_name("wandb")
    on_path = shutil.which("wandb")
    if beside.is_file() and not (on_path and os.path.samefile(on_path, beside)):
        return shlex.quote(str(beside))
    return "wandb"


def sync_all(places: list[tuple[Path, str]]) -> tuple[int, str] | None:
    """(how many runs, one `wandb sync` command) for the offline runs that `places` hold: (directory, glob of run
    directories under it, e.g. "*/" + OFFLINE_RUNS for every run of a sweep), or None when they hold none. The
    globs stay in the command, for the shell to expand: one short line for a sweep of hundreds of runs."""
    counted = [(root, pattern, len(list(Path(root).glob(pattern)))) for root, pattern in places]
    found = sum(n for _, _, n in counted)
    if not found:
        return None
    # a glob that matches nothing would reach wandb as a literal path, which it refuses
    globs = [f"{shlex.quote(str(root))}/{pattern}" for root, pattern, n in counted if n]
    return found, " ".join([sync_command(), "sync", *globs])


def _settings(wandb):
    """Quiet settings: no console capture, no system-metrics sampler (older wandb lacks some keys)."""
    for kwargs in ({"silent": True, "console": "off", "init_timeout": 60, "x_disable_stats": True},
                   {"silent": True, "console": "off"}):
        try:
            return wandb.Settings(**kwargs)
        except Exception:  # noqa: BLE001 - an unknown key in this wandb version
            continue
    return None


def _cell(v):
    """Table cells: scalars and strings as they are, lists/dicts as JSON text (W&B tables want flat cells)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return json.dumps(v)


def _read_state(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / WANDB_RUN).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(run_dir: Path, state: dict) -> None:
    """Remember the W&B run id so `memtrain train --resume` continues the same W&B run."""
    with contextlib.suppress(OSError):
        write_atomic(run_dir / WANDB_RUN, json.dumps(state))
