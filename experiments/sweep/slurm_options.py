"""What a point's cluster job looks like: the cluster options (the command line's over the spec's [slurm]
section), the job's shape (nodes x tasks) and the sbatch script submitit writes for it. jobs.py submits a job
and follows it; slurm.py makes a sweep's points into jobs.

A point's job has N nodes x G tasks (one task per GPU). N follows from the point's grid: its ranks are
parallel.data (1 when -1) x x x y x z, and N = ranks / tasks per node; `--nodes` instead gives every point N
nodes, data parallelism taking the ranks the other degrees leave. Under `--launcher submitit-local` a job is
one node of as many tasks as the point has ranks.

    memtrain sweep paper --launcher slurm --dry-run          # print each point's sbatch script, submit nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from memtrain.commandline import positive_float, positive_int

from .launch import CLUSTER_LAUNCHERS

if TYPE_CHECKING:
    from memtrain.config import RunConfig

_RESERVED = {"nodes", "ntasks-per-node", "gpus-per-node", "time", "partition", "account", "output", "error",
             "job-name", "cpus-per-task", "signal", "open-mode"}


@dataclass
class ClusterOptions:
    """How points become jobs: the command line's options over the spec's [slurm] section."""

    partition: str | None = None
    account: str | None = None
    time: str | int | None = None
    """Time limit per job: minutes, HH:MM:SS or D-HH[:MM[:SS]] (required with slurm)."""
    gpus_per_node: int | None = None
    """GPUs of a node (required with slurm; 0: CPU nodes, then set tasks_per_node)."""
    tasks_per_node: int | None = None
    """Ranks per node (default: gpus_per_node)."""
    nodes: int | None = None
    """Nodes of every job (default: each point's grid decides)."""
    cpus_per_task: int | None = None
    sbatch: list[str] = field(default_factory=list)
    """Extra sbatch directives, 'key=value' or 'key': qos=high, constraint=a100, mem=0, exclusive."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the job runs before srun (module load ..., source venv/bin/activate)."""
    poll_s: float | None = None
    """Seconds between checks of running jobs (default 30 with slurm, 1 with submitit-local)."""


def options_from_spec(raw: dict, source: str) -> dict:
    """Validate a spec's [slurm] section (the ClusterOptions keys), returned as given."""
    names = [f.name for f in dataclasses.fields(ClusterOptions)]
    bad = sorted(set(raw) - set(names))
    if bad:
        raise ValueError(f"sweep spec {source}: unknown [slurm] key(s) {bad}: use {names}")
    for key in ("sbatch", "setup"):
        if not isinstance(raw.get(key, []), list):
            raise ValueError(f"sweep spec {source}: [slurm] {key} must be a list of strings")
    return dict(raw)


def merge(spec_opts: dict, cli: ClusterOptions | None) -> ClusterOptions:
    """The command line wins over the spec; sbatch directives and setup lines add up (the command line's last)."""
    cli = cli or ClusterOptions()
    out = ClusterOptions(**spec_opts)
    for f in dataclasses.fields(ClusterOptions):
        value = getattr(cli, f.name)
        if f.name in ("sbatch", "setup"):
            setattr(out, f.name, list(getattr(out, f.name)) + list(value))
        elif value is not None:
            setattr(out, f.name, value)
    return out


def minutes(value: str | int | None) -> int | None:
    """A SLURM time limit in minutes: 90, '90', '12:00:00', '1-12', '2-00:00:00'."""
    if value is None:
        return None
    text = str(value).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m or isinstance(value, bool):
        raise ValueError(f"--time {value!r} is invalid: use minutes, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        total = int(days) * 1440 + int(a) * 60 + int(b or 0) + (int(c or 0) + 59) // 60
    elif c is not None:  # HH:MM:SS
        total = int(a) * 60 + int(b) + (int(c) + 59) // 60
    elif b is not None:  # MM:SS
        total = int(a) + (int(b) + 59) // 60
    else:
        total = int(a)
    if total < 1:
        raise ValueError(f"--time {value!r} is invalid: a job needs at least one minute")
    return total


def sbatch_extras(items: list[str]) -> dict:
    """'key=value' / 'key' directives as submitit's additional_parameters (written #SBATCH --key=value)."""
    extras = {}
    for item in items:
        key, eq, value = str(item).partition("=")
        key = key.strip().lstrip("-")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", key):
            raise ValueError(f"--sbatch {item!r} is invalid: use KEY=VALUE or KEY (qos=high, constraint=a100)")
        if key.replace("_", "-") in _RESERVED:
            raise ValueError(f"--sbatch {item!r}: {key} is set by its own option (--nodes, --time, --partition, "
                             "...) or by submitit")
        extras[key] = value.strip() if eq else True
    return extras


def check(opts: ClusterOptions, launcher: str) -> None:
    """Fail with one line before anything is prepared or submitted."""
    minutes(opts.time)
    sbatch_extras(opts.sbatch)
    for name in ("gpus_per_node", "tasks_per_node", "nodes", "cpus_per_task"):
        value = getattr(opts, name)
        low = 0 if name == "gpus_per_node" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"--{name.replace('_', '-')} {value!r} is invalid: use an integer >= {low}")
    if opts.poll_s is not None and not opts.poll_s > 0:
        raise ValueError(f"--poll {opts.poll_s!r} is invalid: use a number of seconds > 0")
    if launcher == "submitit-local":
        if opts.nodes not in (None, 1):
            raise ValueError(f"--nodes {opts.nodes}: submitit-local runs on this machine, one node")
        return
    if opts.time is None:
        raise ValueError("--launcher slurm needs a time limit per job: --time HH:MM:SS (or time in the spec's "
                         "[slurm] section)")
    if opts.gpus_per_node is None:
        raise ValueError("--launcher slurm needs --gpus-per-node (or gpus_per_node in the spec's [slurm] section): "
                         "it decides each point's nodes")
    if opts.gpus_per_node == 0 and not opts.tasks_per_node:
        raise ValueError("--gpus-per-node 0 (CPU nodes) needs --tasks-per-node: the ranks each node runs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster options of `memtrain sweep`."""
    cl = parser.add_argument_group("cluster (--launcher slurm or submitit-local; defaults from the spec's [slurm])")
    cl.add_argument("--partition", default=None, help="SLURM partition")
    cl.add_argument("--account", default=None, help="SLURM account to charge")
    cl.add_argument("--time", default=None, metavar="LIMIT",
                    help="time limit of each job: minutes, HH:MM:SS or D-HH:MM:SS (required with slurm); a job "
                         "that reaches it is requeued and resumes from its last checkpoint")
    cl.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                    help="GPUs per node, one task (rank) each (required with slurm)")
    cl.add_argument("--tasks-per-node", type=positive_int, default=None, metavar="T",
                    help="ranks per node (default: --gpus-per-node; needed for CPU nodes)")
    cl.add_argument("--nodes", type=positive_int, default=None,
                    help="nodes of every job (default: from each point's grid: the product of its parallel degrees, "
                         "data=-1 counted as 1, over the tasks per node)")
    cl.add_argument("--cpus-per-task", type=positive_int, default=None, help="CPUs per task")
    cl.add_argument("--sbatch", action="append", default=[], metavar="KEY[=VALUE]",
                    help="extra sbatch directive, repeatable: qos=high, constraint=a100, mem=0, exclusive")
    cl.add_argument("--setup", action="append", default=[], metavar="LINE",
                    help="shell line each job runs before srun, repeatable (module load ..., source .../activate)")
    cl.add_argument("--poll", type=positive_float, default=None, metavar="SECONDS",
                    help="seconds between checks of the jobs (default 30 with slurm, 1 with submitit-local)")
    cl.add_argument("--no-wait", action="store_true",
                    help="submit and exit; `--resume` later collects finished jobs and resubmits the missing")
    cl.add_argument("--dry-run", action="store_true",
                    help="print each point's sbatch script (with --launcher slurm) and exit: nothing submitted")


_CLUSTER_FLAGS = ("partition", "account", "time", "gpus_per_node", "tasks_per_node", "nodes", "cpus_per_task",
                  "sbatch", "setup", "poll", "no_wait", "dry_run")


def options_from_args(args) -> ClusterOptions | None:
    """The cluster options of the command line; a cluster flag without a cluster launcher is a one-line error."""
    given = [f for f in _CLUSTER_FLAGS if getattr(args, f) not in (None, False, [])]
    if args.launcher not in CLUSTER_LAUNCHERS:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is for cluster sweeps: add --launcher slurm (or "
                             "submitit-local)")
        return None
    if args.nproc is not None:
        raise ValueError(f"--nproc is for --launcher torchrun: with {args.launcher} each point's grid decides its "
                         "ranks (--nodes, --gpus-per-node, --tasks-per-node)")
    if args.dry_run and args.launcher != "slurm":
        raise ValueError("--dry-run prints sbatch scripts: use it with --launcher slurm")
    return ClusterOptions(partition=args.partition, account=args.account, time=args.time,
                          gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node, nodes=args.nodes,
                          cpus_per_task=args.cpus_per_task, sbatch=args.sbatch, setup=args.setup, poll_s=args.poll)


# ---------------------------------------------------------------------------------------------------
# a point's job: its shape and its sbatch script


@dataclass(frozen=True)
class Shape:
    nodes: int
    tasks_per_node: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    def __str__(self) -> str:
        gpus = f", {self.gpus_per_node} GPU(s) each" if self.gpus_per_node else ""
        return f"{self.nodes} node(s) x {self.tasks_per_node} task(s){gpus} = {self.world} rank(s)"


def shape(cfg: RunConfig, opts: ClusterOptions, local: bool, what: str = "point") -> Shape:
    """Nodes x tasks of the job that trains `cfg`: from its grid, or --nodes with data parallelism filling it."""
    p = cfg.parallel
    model = p.x * p.y * p.z
    gpus = opts.gpus_per_node or 0
    per_node = opts.tasks_per_node or gpus
    grid = f"parallel.data={p.data} x={p.x} y={p.y} z={p.z}"
    if local:
        world = model * (p.data if p.data != -1 else 1)
        return Shape(1, world, min(gpus, world))
    if opts.nodes:
        world = opts.nodes * per_node
        if world % model or (p.data != -1 and p.data * model != world):
            raise ValueError(f"{what}: --nodes {opts.nodes} x {per_node} tasks = {world} ranks do not fit its grid "
                             f"({grid}): the product of x, y, z must divide them, and data times it equal them")
        return Shape(opts.nodes, per_node, gpus)
    world = model * (p.data if p.data != -1 else 1)
    if world <= per_node:
        return Shape(1, world, min(gpus, world))
    if world % per_node:
        raise ValueError(f"{what}: its grid ({grid}) has {world} ranks, not a multiple of {per_node} tasks per "
                         "node: change the degrees, or give --nodes")
    return Shape(world // per_node, per_node, gpus)


def slurm_parameters(opts: ClusterOptions, sh: Shape, name: str, command: list[str]) -> dict:
    """SlurmExecutor's parameters for one job."""
    describe = f"# each of the {sh.world} task(s) runs: {shlex.join([str(c) for c in command])}"
    return {k: v for k, v in {
        "job_name": name, "time": minutes(opts.time), "nodes": sh.nodes, "ntasks_per_node": sh.tasks_per_node,
        "gpus_per_node": sh.gpus_per_node or None, "cpus_per_task": opts.cpus_per_task,
        "partition": opts.partition, "account": opts.account, "setup": [describe] + list(opts.setup),
        "additional_parameters": sbatch_extras(opts.sbatch) or None}.items() if v is not None}


def sbatch_script(folder: Path, params: dict) -> str:
    """The sbatch script submitit writes for these parameters, rendered without a cluster. submitit renders one
    only while submitting (no public call does it alone), so this is the one place reaching into its internals:
    an executor class whose srun check is skipped, and its _make_submission_file_text."""
    import submitit  # not at the top: a spec's [slurm] section is validated here, and needs no submitit (0.1 s)

    class _Renderer(submitit.SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            return 1  # no srun needed to render

    ex = _Renderer(folder)
    ex.update_parameters(**params)
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")
