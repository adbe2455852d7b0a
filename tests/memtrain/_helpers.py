"""What the `memtrain` command tests share: the command run in a process of its own (`memtrain`, forked from a warm
server, or `memtrain_cold`, a new interpreter as a user starts it) or in this process (`cli`, for the commands'
checks that end before any work), a tiny recipe and a small stdlib corpus."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from experiments.sweep import warm

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
ENV = dict(os.environ, **SETTINGS, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
CPU_RANKS = dict(ENV, CUDA_VISIBLE_DEVICES="")
"""ENV for the 2-rank torchrun tests: gloo CPU ranks on any machine (NCCL wants a GPU per rank, and a GPU machine
that runs the tests may have one)."""


_server: warm.Server | None = None  # memtrain's, started at its first call


def memtrain(*args) -> subprocess.CompletedProcess:
    """`memtrain ARGS` in a process of its own: its exit code, stdout and stderr. The process is forked from a warm
    server that imported memtrain's modules once for this test process (experiments.sweep.warm, the runner of the
    sweep's runs) in ENV and the working directory of `memtrain_cold`: a cold start pays ~5 s of imports per call,
    a fork milliseconds. What differs from a new interpreter is `memtrain_cold`'s to check: what imports print
    (once, in the server), and the interpreter's exit (the fork ends with os._exit after main)."""
    global _server
    if _server is None or _server.ended:
        _server = warm.Server(ENV)
    with tempfile.TemporaryDirectory() as logs:
        code = _server.run([str(a) for a in args], logs, str(ROOT))
        out, err = (Path(logs, name).read_text("utf-8", "replace") for name in ("stdout.log", "stderr.log"))
    return subprocess.CompletedProcess(["memtrain", *map(str, args)], code, out, err)


def memtrain_cold(*args, timeout=120) -> subprocess.CompletedProcess:
    """`python -m memtrain ARGS` as a user starts it, a new interpreter."""
    return subprocess.run([sys.executable, "-m", "memtrain", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=timeout)


def cli(*args) -> subprocess.CompletedProcess:
    """`memtrain ARGS` as `memtrain` runs it, but in this process (memtrain.cli.main): its exit code, stdout and
    stderr (warnings shown there under Python's default filters, an uncaught exception's traceback and exit code 1,
    as the interpreter would), with the environment and working directory of `memtrain`. For bad input and help,
    which end before any real work: a process pays ~2 s of imports for each. Whatever the command leaves in this
    process is undone: environment, working directory, signal handlers, torch's RNG and determinism, a process
    group (parallel.shutdown), run-directory locks; it must not leave threads running."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with _isolated(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.resetwarnings()  # Python's defaults, as a new interpreter has them
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        from memtrain.cli import main

        try:
            code = main(argv)
        except SystemExit as e:  # argparse (--help, usage errors); a message instead of a code: printed, exit 1
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if code == 1 and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["memtrain", *argv], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _isolated():
    import threading

    import torch.distributed as dist

    from memtrain.training import run_dir

    environ, cwd = dict(os.environ), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    rng, deterministic, threads = torch.get_rng_state(), torch.are_deterministic_algorithms_enabled(), \
        torch.get_num_threads()
    held, alive = set(run_dir._HELD), set(threading.enumerate())
    assert not dist.is_initialized(), "a process group is left from an earlier test"
    os.environ.update(SETTINGS)
    os.chdir(ROOT)
    try:
        yield
    finally:
        import parallel

        parallel.shutdown()
        for path in set(run_dir._HELD) - held:
            run_dir.release(path)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        torch.set_rng_state(rng)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
    # tqdm's monitor is one per process, started by the first bar (a corpus read shows one) and idle afterwards
    left = [t.name for t in set(threading.enumerate()) - alive if t.is_alive() and t.name != "tqdm_monitor"]
    assert not left, f"the command left threads running: {left}"


def stdlib_corpus(root: Path, every: int, count: int, chars: int) -> Path:
    """Every `every`-th top-level stdlib module (at most `count`), its first `chars` characters a .txt file."""
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::every][:count]:
        (root / f"{p.stem}.txt").write_text(p.read_text("utf-8")[:chars])
    return root


TINY = {
    "model": {"name": "ladder-1m"},
    # bitwise claims (resume equals uninterrupted) hold on a GPU only with deterministic kernels
    "train": {"batch_size": 8, "max_steps": 6, "lr": 3e-3, "warmup_steps": 2,
              "deterministic": torch.cuda.is_available()},
    "data": {"vocab_size": 512, "seq_len": 64},
    "canaries": {"number": 2, "copies": [1, 2], "length": 24, "secret_groups": 2},
    "eval": {"suffix_len": 8, "exposure_samples": 64, "val_docs": 8},
    "wandb": {"mode": "disabled"},
}
"""A run that trains and evaluates in seconds: the tests' recipe, changed per test by `write_recipe`."""


def write_recipe(path: Path, corpus: Path, cache: Path, **changes: dict) -> Path:
    """TINY over `corpus` (stream cache in `cache`) with `changes` ({section: {key: value}}) merged in, written
    as a TOML recipe at `path`. Validated on the way: a recipe the CLI would refuse fails here."""
    from memtrain.config import from_dict, to_toml

    raw = {section: dict(values) for section, values in TINY.items()}
    raw["data"].update(corpus=str(corpus), cache_dir=str(cache))
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(to_toml(from_dict(raw)))
    return path


def checkpoint_files(step_dir: Path) -> dict:
    """Every tensor of a checkpoint directory, keyed '<file>/<piece>': two checkpoints saved on the same grid
    are bitwise equal iff these are."""
    from safetensors.torch import load_file

    files = sorted(Path(step_dir).glob("*.safetensors"))
    return {f"{f.name}/{k}": v for f in files for k, v in load_file(str(f)).items()}


def snapshot(root) -> dict:
    """Every file under `root` (a link: its target), by relative path: what a refused command must leave alone."""
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                files[os.path.relpath(path, root)] = os.readlink(path)
                continue
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def unchanged(before: dict, root) -> bool:
    """Every file of `before` as it was (new files, such as a cache's or a run's lock, may appear)."""
    after = snapshot(root)
    return {path: after.get(path) for path in before} == before


def refused(r, expect: str) -> str:
    """The error line of a refused command: non-zero exit, exactly one `memtrain: error:` line, the last on stderr
    (progress lines may come before it), naming `expect`, and no traceback."""
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("memtrain: error:"), r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == errors[0], r.stderr[-3000:]
    assert expect in errors[0], errors[0]
    return errors[0]


def finished_tiny_run(root: Path) -> Path:
    """A workspace for bad-input tests: 12 stdlib files in root/corpus, the recipe root/tiny.toml (2 steps, one
    canary), and that recipe trained and evaluated into root/run. Returns the recipe."""
    (root / "corpus").mkdir()
    corpus = stdlib_corpus(root / "corpus", every=12, count=12, chars=4000)
    recipe = write_recipe(root / "tiny.toml", corpus, root / "cache", train={"batch_size": 4, "max_steps": 2},
                          canaries={"number": 1, "copies": [1], "length": 16},
                          eval={"suffix_len": 4, "exposure_samples": 8, "val_docs": 2})
    r = memtrain("train", "--config", recipe, "--out", root / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    return recipe
