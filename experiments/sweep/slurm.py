"""Cluster sweeps: every point of a sweep is one job of its own nodes and GPUs (jobs.py), its shape and sbatch
script following from its grid (slurm_options.py).

    memtrain sweep paper --launcher slurm --partition gpu --account proj42      # submit, then collect as jobs end
    memtrain sweep paper --launcher slurm --dry-run          # print each point's sbatch script, submit nothing
    memtrain sweep paper --launcher slurm --no-wait          # submit and exit; later, from any shell:
    memtrain sweep paper --launcher slurm --resume           # collect what finished, resubmit failed/missing points

A point is prepared as it would be here (point.py: base model, run directory, command) and submitted; its
record is made when its job ends. Each run directory holds its job: job.json (job id, tasks, config digest,
base model, when submitted) and submitit/. `--resume` reads job.json: a job still queued or running is waited
for, never submitted twice; a finished job whose result is not in results.jsonl yet is collected; a failed or
missing point is submitted again, continuing from its last checkpoint.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.results import now
from memtrain.files import read_jsonl, write_atomic

from .jobs import LOGS, Cluster
from .launch import train_tail
from .point import PointLife
from .spec import Point, Spec

JOB_FILE = "job.json"


@dataclass
class _Flight:
    point: Point
    job: object
    run_dir: Path
    info: dict
    reattached: bool = False


def read_job(run_dir: Path) -> dict | None:
    try:
        info = json.loads((run_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("job_id") else None


def recorded_jobs(results: Path) -> set[str]:
    return {str(r["job"]["id"]) for r in read_jsonl(results) if isinstance(r.get("job"), dict)}


def dry_run(spec: Spec, points: list[Point], out: Path, cluster: Cluster, prefix: list[str]) -> str:
    """Every point's sbatch script, as --launcher slurm would submit it."""
    parts = []
    for p in points:
        run_dir = (out / p.id).absolute()
        sh, text = cluster.script(run_dir, p.cfg, f"{spec.name}-{p.id}", prefix + train_tail(run_dir))
        pretrain = spec.pretrain.applies_to(p.cfg)
        note = " (after its base model is pretrained: a job of the same shape)" if pretrain else ""
        parts.append(f"#### {p.id}: {sh}{note}\n{text}")
    return "\n".join(parts)


def run_points(life: PointLife, todo: list[Point], cluster: Cluster, *, limit: int | None, wait: bool) -> list[str]:
    """Submit `todo` as jobs, at most `limit` queued or running at once, and finish each point (life.finish)
    as its job ends. Returns the ids of points still queued, running or unsubmitted. `life.out` is absolute:
    jobs start in the submitting shell's directory, wherever that is."""
    if todo:
        cluster.require_scheduler()
    done_jobs = recorded_jobs(life.results)
    queue: list[Point] = []
    flights: list[_Flight] = []
    for p in todo:  # first the jobs an earlier sweep left: wait for them, collect them, or submit again
        run_dir = life.out / p.id
        info = read_job(run_dir) if life.resume else None
        if info is None or info.get("cluster") != cluster.kind:
            queue.append(p)
            continue
        f = _Flight(p, cluster.reattach(run_dir, info), run_dir, info, reattached=True)
        if cluster.running(f.job, True):
            if info.get("digest") != p.digest:
                raise ValueError(f"{p.id}: job {info['job_id']} of an older config is still queued or running: "
                                 f"cancel it (scancel {info['job_id']}) or wait for it, then --resume")
            life.log(f"{p.id}: job {info['job_id']} still queued or running: waiting for it")
            flights.append(f)
        elif str(info["job_id"]) not in done_jobs and info.get("digest") == p.digest:
            if _collect(f, life, cluster) != "ok":
                queue.append(p)
        else:
            queue.append(p)

    # base models first, side by side as jobs of their points' shape
    life.bases.build_first([p.cfg for p in queue])
    total = len(queue)
    while queue or flights:
        while queue and (limit is None or len(flights) < limit):
            p = queue.pop(0)
            f = _submit(p, life, cluster, total - len(queue), total)
            if f is not None:
                flights.append(f)
        if not wait:
            break
        for f in [f for f in flights if not cluster.running(f.job, f.reattached)]:
            flights.remove(f)
            _collect(f, life, cluster)
        if flights or queue:
            time.sleep(cluster.poll_s)
    return [f.point.id for f in flights] + [p.id for p in queue]


def _submit(p: Point, life: PointLife, cluster: Cluster, i: int, n: int) -> _Flight | None:
    launch = life.prepare(p)
    if launch is None:  # its base model failed: recorded already
        return None
    run_dir = launch.run_dir
    job, sh = cluster.submit(launch.command, run_dir, p.cfg, f"{life.spec.name}-{p.id}")
    info = {"job_id": str(job.job_id), "cluster": cluster.kind, "tasks": sh.world, "nodes": sh.nodes,
            "tasks_per_node": sh.tasks_per_node, "digest": p.digest,
            "base_dir": str(launch.base_dir) if launch.base_dir else None, "submitted": now(),
            "command": launch.command, "resumed": launch.resumed}
    write_atomic(run_dir / JOB_FILE, json.dumps(info, indent=1))
    life.log(f"[{i}/{n}] {p.id}: job {job.job_id} submitted ({sh}){', resuming' if launch.resumed else ''}; "
               f"logs in {run_dir / LOGS}")
    return _Flight(p, job, run_dir, info)


def _collect(f: _Flight, life: PointLife, cluster: Cluster) -> str:
    """Finish the point of a job that has ended: its record, with the job and the log to read if it failed."""
    status, error, result = cluster.outcome(f.job)
    seconds = result.get("seconds")
    if seconds is None:  # failed: the time since submission, queueing included
        t0 = _parse_time(f.info.get("submitted"))
        seconds = time.time() - t0 if t0 else 0.0
    base_dir = Path(f.info["base_dir"]) if f.info.get("base_dir") else None
    started = result.get("started") or f.info.get("submitted") or now()
    record = life.record(f.point, f.run_dir, base_dir, status, error, started, seconds)
    log_path = f.job.task(0).paths.stderr
    if record["status"] != "ok" and "[log:" not in (record["error"] or ""):
        record["error"] = f"{record['error']} [log: {log_path}]"
    record["job"] = {"id": str(f.job.job_id), "cluster": cluster.kind, "nodes": f.info.get("nodes"),
                     "tasks_per_node": f.info.get("tasks_per_node"), "log": str(log_path)}
    life.finish(record)
    return record["status"]


def _parse_time(stamp: str | None) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(stamp).timestamp() if stamp else None
    except ValueError:
        return None
