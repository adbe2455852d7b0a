"""Cluster sweeps (experiments/slurm.py): every point one job through submitit. Here jobs run through submitit's
LocalExecutor (`--launcher submitit-local`, the same code path as SLURM), and the sbatch scripts of the `paper`
preset are checked directive by directive (`--launcher slurm --dry-run`: no cluster needed)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pytest

from experiments import slurm, slurm_options, sweep
from experiments import spec as specs
from memtrain.config import from_dict
from tests.experiments import _fake_slurm as fake_slurm
from tests.experiments._helpers import IDS, SPEC, launched, results
from tests.memtrain.training._helpers import TINY, stdlib_corpus

LOCAL = ["--launcher", "submitit-local", "--poll", "0.2"]


# ---------------------------------------------------------------------------------------------------
# (a) a real sweep, every point a job of its grid's ranks


def test_real_sweep_through_submitit_local_appends_results_as_jobs_finish(tmp_path, monkeypatch):
    """Two points of the tiny recipe as two jobs side by side: one rank, and two ranks (parallel.data=2: two tasks
    that find their ranks as srun's tasks do). Each result line is in results.jsonl when its job is reported."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib_corpus(corpus, every=7, count=24, chars=3000)
    base = {section: dict(values) for section, values in TINY.items()}
    base["data"].update(corpus=str(corpus), cache_dir=str(tmp_path / "cache"))
    base["train"].update(max_steps=4)
    base["eval"].update(exposure_samples=16, val_docs=4)
    spec = specs.parse_spec({"sweep": {"name": "tiny"}, "base": base, "axes": {"grid": [
        {"label": "one-rank", "loss.kind": "standard"},
        {"label": "two-ranks", "loss.kind": "goldfish", "loss.k": 4, "parallel.data": 2}]}})
    out = tmp_path / "runs"
    seen = []

    def log(*args, **kwargs):
        line = " ".join(map(str, args))
        m = re.match(r"(\S+): (ok|FAILED)", line)
        if m:  # the job's line is appended before the sweep says it finished
            seen.append((m.group(1), [r["point"] for r in results(out)]))

    t0 = time.time()
    summary = sweep.run_sweep(spec, out, launcher="submitit-local", cluster=slurm_options.ClusterOptions(poll_s=0.2),
                              report=False, log=log)
    assert summary["ok"] == 2 and summary["failed"] == 0 and not summary["pending"], results(out)
    assert len(seen) == 2 and [points[-1] for _, points in seen] == [pid for pid, _ in seen]  # appended as each ended
    rows = {r["point"]: r for r in results(out)}
    for pid, ranks in (("one-rank", 1), ("two-ranks", 2)):
        r = rows[pid]
        assert r["status"] == "ok" and r["eval"]["exact_match_rate"] is not None, r["error"]
        assert r["run"]["grid"]["data"] == ranks and r["job"]["cluster"] == "local"
        info = json.loads((out / pid / "job.json").read_text())
        assert info["tasks"] == ranks and info["job_id"] == r["job"]["id"] and info["digest"] == r["config_digest"]
        logs = sorted(p.name for p in (out / pid / "submitit").glob("*_log.out"))
        assert logs == [f"{info['job_id']}_{t}_log.out" for t in range(ranks)]  # one log per task, in the run
    assert rows["two-ranks"]["train"]["kept_fraction"] < 0.95
    print(f"two real jobs in {time.time() - t0:.0f}s")


# ---------------------------------------------------------------------------------------------------
# (b) failures, --resume, jobs left running


def test_failed_job_is_named_with_its_log_and_resume_resubmits_only_it(env, capsys):
    out = env["tmp"] / "runs"
    os.environ["FAKE_FAIL"] = "ladder-3m_standard"
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only",
            "ladder-1m_standard|ladder-3m_standard", *LOCAL]
    assert sweep.main(argv) == 1
    rows = results(out)
    assert sorted(r["point"] for r in rows) == ["ladder-1m_standard", "ladder-3m_standard"]
    bad = [r for r in rows if r["status"] != "ok"]
    assert [r["point"] for r in bad] == ["ladder-3m_standard"]
    job_id = json.loads((out / "ladder-3m_standard" / "job.json").read_text())["job_id"]
    log = out / "ladder-3m_standard" / "submitit" / f"{job_id}_0_log.err"
    assert bad[0]["error"] == f"ValueError: planned failure of ladder-3m_standard [log: {log}]"
    assert "planned failure" in log.read_text() and bad[0]["job"]["log"] == str(log)
    printed = capsys.readouterr()
    assert "ladder-3m_standard: FAILED" in printed.out and str(log) in printed.out
    assert "1 point(s) failed (ladder-3m_standard)" in printed.err

    # without --resume the directory's jobs are never mixed into
    assert sweep.main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err

    before = (out / "results.jsonl").read_bytes()
    n = len(launched(env["log"]))
    os.environ["FAKE_FAIL"] = ""
    assert sweep.main(argv + ["--resume"]) == 0
    assert [x["name"] for x in launched(env["log"])[n:]] == ["ladder-3m_standard"]  # only the failed point
    assert (out / "results.jsonl").read_bytes().startswith(before)  # appended, never rewritten
    assert json.loads((out / "ladder-3m_standard" / "job.json").read_text())["job_id"] != job_id


def test_resume_collects_a_finished_job_and_resubmits_a_removed_point(env):
    """Two points lose their results line (the sweep died before appending it): one still has its run directory
    and job.json, so its finished job is collected, not run again; the other's directory is gone too, so only
    it is submitted again."""
    out = env["tmp"] / "runs"
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only", "ladder-1m",
            *LOCAL]
    assert sweep.main(argv) == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2
    lost, removed = json.loads(lines[-1]), json.loads(lines[-2])
    (out / "results.jsonl").write_text("")
    shutil.rmtree(out / removed["point"])
    n = len(launched(env["log"]))
    assert sweep.main(argv + ["--resume"]) == 0
    assert [x["name"] for x in launched(env["log"])[n:]] == [removed["point"]]
    rows = results(out)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert {r["point"] for r in rows} == {lost["point"], removed["point"]}
    again = {r["point"]: r["job"]["id"] for r in rows}
    assert again[lost["point"]] == lost["job"]["id"] and again[removed["point"]] != removed["job"]["id"]


def test_resume_waits_for_jobs_still_running_and_never_submits_them_twice(env, capsys):
    out = env["tmp"] / "runs"
    os.environ["FAKE_SLEEP"] = "4"
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only", "ladder-1m",
            *LOCAL]
    assert sweep.main(argv + ["--no-wait"]) == 0  # submitted; this "sweep" exits, the jobs go on
    printed = capsys.readouterr().out
    assert "2 queued, running or not yet submitted" in printed
    assert not (out / "results.jsonl").exists()
    ids = {pid: json.loads((out / pid / "job.json").read_text())["job_id"] for pid in IDS[:2]}
    assert sweep.main(argv + ["--resume"]) == 0
    printed = capsys.readouterr().out
    for pid, job_id in ids.items():
        assert f"{pid}: job {job_id} still queued or running: waiting for it" in printed
    assert len(launched(env["log"])) == 2  # each point ran once
    assert sorted((r["point"], r["job"]["id"]) for r in results(out)) == sorted(ids.items())


def test_a_job_at_its_time_limit_is_requeued_and_resumes_from_its_checkpoint(env):
    """--time 1 on submitit-local: 30 s before the limit submitit warns the task (as SLURM's --signal does), which
    requeues the job with TrainJob.checkpoint(): the same command with --resume. The trainer, which ignores the
    warning, is stopped; the requeued job resumes and ends ok: one job, one result."""
    out = env["tmp"] / "runs"
    os.environ["FAKE_SLEEP"] = "300"  # longer than the limit: only the requeue can finish it
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only",
            "ladder-1m_standard", "--time", "1", *LOCAL]
    assert sweep.main(argv) == 0
    runs = launched(env["log"])
    assert [r["resume"] for r in runs] == [False, True]
    rows = results(out)
    assert len(rows) == 1 and rows[0]["status"] == "ok"
    job_id = json.loads((out / "ladder-1m_standard" / "job.json").read_text())["job_id"]
    assert rows[0]["job"]["id"] == job_id
    logs = out / "ladder-1m_standard" / "submitit"
    assert "this job is timed-out" in (logs / f"{job_id}_0_log.err").read_text()
    assert (logs / f"{job_id}_0_log.out").read_text().count("memtrain task 0/1:") == 2  # two attempts, one job


def test_a_jobs_limit_keeps_at_most_that_many_in_flight(env, capsys):
    out = env["tmp"] / "runs"
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only", "ladder-1m",
            "--jobs", "1", *LOCAL]
    assert sweep.main(argv + ["--no-wait"]) == 0
    printed = capsys.readouterr().out
    assert len(re.findall(r": job \d+ submitted", printed)) == 1 and "2 queued, running or not yet submitted" in printed
    assert sweep.main(argv + ["--resume"]) == 0
    rows = results(out)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    second = json.loads((out / rows[1]["point"] / "job.json").read_text())["submitted"]
    assert rows[0]["finished"] <= second  # submitted once the first had ended


def test_base_models_are_pretrained_as_jobs_first(env, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(f"w{(i * j) % 17}" for j in range(100)) + "\n")
    spec = tmp_path / "based.toml"
    spec.write_text(SPEC + textwrap.dedent(f'''
        [base.data]
        corpus = "{corpus}"
        vocab_size = 300
        [pretrain]
        steps = 5
        corpus = "same"
    '''))
    out = tmp_path / "based"
    argv = [str(spec), "--out", str(out), "--runner", env["runner"], "--no-report", "--only", "ladder-1m_standard",
            *LOCAL]
    assert sweep.main(argv) == 0
    runs = launched(env["log"])
    assert [r["pretrain"] for r in runs] == [True, False]  # the base, then the point
    rows = results(out)
    assert all(r["status"] == "ok" and r["base_dir"] for r in rows)
    base = Path(rows[0]["base_dir"])
    assert (base / "base.json").is_file() and list((base / "submitit").glob("*_log.out"))
    assert all(r["init"] == str(base) for r in runs[1:])


def test_slurm_jobs_through_a_stand_in_slurm(env, monkeypatch, capsys):
    """--launcher slurm itself, on sbatch/srun/sacct stand-ins (_fake_slurm.py): submitted with sbatch, every
    task started by srun with its SLURM_PROCID, failures named with their log, --resume resubmitting only them,
    and a job still RUNNING by sacct waited for, not submitted again."""
    fake_slurm.install(env["tmp"] / "bin")
    monkeypatch.setenv("PATH", f"{env['tmp'] / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_STATE", str(env["tmp"] / "slurm"))
    out = env["tmp"] / "runs"
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only",
            "ladder-1m_standard|ladder-3m_standard", "--launcher", "slurm", "--partition", "cpu", "--time", "5",
            "--gpus-per-node", "0", "--tasks-per-node", "2", "--nodes", "1", "--poll", "0.2"]
    os.environ["FAKE_FAIL"] = "ladder-3m_standard"
    assert sweep.main(argv) == 1
    runs = launched(env["log"])
    assert sorted((r["name"], r["rank"]) for r in runs) == [(pid, rank) for pid in ("ladder-1m_standard",
                                                                                    "ladder-3m_standard")
                                                            for rank in ("0", "1")]  # two srun tasks a job
    rows = {r["point"]: r for r in results(out)}
    info = {pid: json.loads((out / pid / "job.json").read_text()) for pid in rows}
    assert rows["ladder-1m_standard"]["status"] == "ok" and info["ladder-1m_standard"]["cluster"] == "slurm"
    log = out / "ladder-3m_standard" / "submitit" / f"{info['ladder-3m_standard']['job_id']}_0_log.err"
    assert rows["ladder-3m_standard"]["error"].endswith(f"planned failure of ladder-3m_standard [log: {log}]")
    script = (env["tmp"] / "slurm" / f"{info['ladder-1m_standard']['job_id']}.sbatch").read_text()
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition=cpu", "#SBATCH --time=5"):
        assert line in script.splitlines()

    os.environ["FAKE_FAIL"] = ""
    n = len(runs)
    assert sweep.main(argv + ["--resume"]) == 0
    assert sorted(r["name"] for r in launched(env["log"])[n:]) == ["ladder-3m_standard"] * 2

    # a job still running when the sweep that submitted it is gone: --resume waits for it (sacct says RUNNING)
    os.environ["FAKE_SLEEP"] = "3"
    other = env["tmp"] / "later"
    argv[argv.index("--out") + 1] = str(other)
    argv[argv.index("--only") + 1] = "ladder-10m_standard"
    assert sweep.main(argv + ["--no-wait"]) == 0
    job_id = json.loads((other / "ladder-10m_standard" / "job.json").read_text())["job_id"]
    capsys.readouterr()
    assert sweep.main(argv + ["--resume"]) == 0
    assert f"job {job_id} still queued or running: waiting for it" in capsys.readouterr().out
    assert [r["job"]["id"] for r in results(other)] == [job_id]


# ---------------------------------------------------------------------------------------------------
# (c) the paper preset's sbatch scripts


def _scripts(text: str) -> dict[str, tuple[str, list[str]]]:
    parts = re.split(r"^#### (\S+): (.*)$", text, flags=re.M)[1:]
    return {parts[i]: (parts[i + 1], parts[i + 2].strip().splitlines()) for i in range(0, len(parts), 3)}


def test_paper_sbatch_scripts_checked_line_by_line(tmp_path, capsys):
    out = tmp_path / "paper"
    rc = sweep.main(["paper", "--launcher", "slurm", "--dry-run", "--out", str(out), "--partition", "batch",
                     "--account", "csc123", "--sbatch", "qos=normal", "--sbatch", "constraint=nvme",
                     "--setup", "module load rocm"])
    assert rc == 0
    scripts = _scripts(capsys.readouterr().out)
    assert not out.exists()  # a dry run writes nothing
    expected = {"8b": (1, 8), "70b": (8, 64), "405b": (64, 512)}
    assert sorted(scripts) == sorted(f"{s}_{loss}" for s in expected for loss in ("standard", "goldfish-k4"))
    for pid, (summary, lines) in scripts.items():
        nodes, ranks = expected[pid.split("_")[0]]
        assert summary == f"{nodes} node(s) x 8 task(s), 8 GPU(s) each = {ranks} rank(s)"
        run = out.absolute() / pid
        assert lines[0] == "#!/bin/bash"
        directives = [x for x in lines if x.startswith("#SBATCH")]
        assert directives == sorted(directives)  # submitit writes them sorted: one of each, nothing else
        d = dict(x[len("#SBATCH --"):].split("=", 1) for x in directives)
        assert d == {"account": "csc123", "constraint": "nvme", "error": f"{run}/submitit/%j_0_log.err",
                     "gpus-per-node": "8", "job-name": f"paper-{pid}", "nodes": str(nodes), "ntasks-per-node": "8",
                     "open-mode": "append", "output": f"{run}/submitit/%j_0_log.out", "partition": "batch",
                     "qos": "normal", "signal": "USR2@90", "time": "1440", "wckey": "submitit"}
        setup = lines.index("# setup")
        task = shlex.split(lines[setup + 1].split(": ", 1)[1])
        assert lines[setup + 1].startswith(f"# each of the {ranks} task(s) runs: ")
        assert task == [sys.executable, "-m", "memtrain", "train", "--config", f"{run}/config.toml", "--out", str(run)]
        assert lines[setup + 2] == "module load rocm"
        srun = shlex.split(lines[-1])
        assert srun == ["srun", "--unbuffered", "--output", f"{run}/submitit/%j_%t_log.out", "--error",
                        f"{run}/submitit/%j_%t_log.err", sys.executable, "-u", "-m", "submitit.core._submit",
                        f"{run}/submitit"]
        assert lines[-2] == "export SUBMITIT_EXECUTOR=slurm"


def test_nodes_option_and_cpu_nodes_change_the_scripts(tmp_path, capsys):
    argv = ["paper", "--launcher", "slurm", "--dry-run", "--out", str(tmp_path), "--only", "8b_standard"]
    assert sweep.main(argv + ["--nodes", "2", "--time", "1-12:30"]) == 0  # data parallel fills 2 nodes
    (summary, lines), = _scripts(capsys.readouterr().out).values()
    assert summary.endswith("= 16 rank(s)") and "#SBATCH --nodes=2" in lines and "#SBATCH --time=2190" in lines
    assert sweep.main(argv + ["--gpus-per-node", "0", "--tasks-per-node", "4"]) == 0
    (summary, lines), = _scripts(capsys.readouterr().out).values()
    assert summary == "2 node(s) x 4 task(s) = 8 rank(s)" and not any("gpus" in x for x in lines)


# ---------------------------------------------------------------------------------------------------
# (d) bad input: one line, exit 2


@pytest.mark.parametrize("argv, message", [
    (["--launcher", "slurm", "--resume"], "--launcher slurm needs a time limit per job"),
    (["--launcher", "slurm", "--time", "10"], "--launcher slurm needs --gpus-per-node"),
    (["--launcher", "slurm", "--time", "10", "--gpus-per-node", "8"], "no `sbatch` on this machine"),
    (["--launcher", "slurm", "--time", "ten", "--gpus-per-node", "8"], "--time 'ten' is invalid"),
    (["--launcher", "slurm", "--time", "0", "--gpus-per-node", "8"], "at least one minute"),
    (["--launcher", "slurm", "--time", "9", "--gpus-per-node", "0"], "--gpus-per-node 0 (CPU nodes) needs"),
    (["--launcher", "slurm", "--time", "9", "--gpus-per-node", "8", "--sbatch", "nodes=3"], "set by its own option"),
    (["--launcher", "slurm", "--time", "9", "--gpus-per-node", "8", "--sbatch", "=x"], "use KEY=VALUE or KEY"),
    (["--launcher", "slurm", "--nproc", "4"], "--nproc is for --launcher torchrun"),
    (["--partition", "gpu"], "--partition is for cluster sweeps: add --launcher slurm"),
    (["--launcher", "torchrun", "--dry-run"], "--dry-run is for cluster sweeps: add --launcher slurm"),
    (["--launcher", "submitit-local", "--dry-run"], "--dry-run prints sbatch scripts: use it with --launcher slurm"),
    (["--launcher", "submitit-local", "--nodes", "2"], "submitit-local runs on this machine, one node"),
    (["--launcher", "submitit-local", "--poll", "0"], "argument --poll: 0"),
    (["--launcher", "slurm-cluster"], "invalid choice: 'slurm-cluster'"),
    (["--launcher", "slurm", "--qos", "high"], "unrecognized arguments: --qos high"),
])
def test_bad_cluster_input_is_one_line(env, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # no sbatch, even on a cluster's login node
    try:
        rc = sweep.main([str(env["spec"]), "--out", str(env["tmp"] / "runs"), *argv])
    except SystemExit as e:  # argparse's errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memtrain: error: ") and message in err, err
    assert not (env["tmp"] / "runs" / "results.jsonl").exists()


def test_a_grid_that_does_not_fill_whole_nodes_is_refused_in_one_line(tmp_path, capsys):
    spec = tmp_path / "odd.toml"
    spec.write_text(SPEC + '\n[slurm]\ngpus_per_node = 8\ntime = 60\n')
    argv = [str(spec), "--launcher", "slurm", "--dry-run", "--set", "parallel.data=3", "--set", "parallel.x=4"]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "its grid (parallel.data=3 x=4 y=1 z=1) has 12 ranks, not a multiple of 8" in err
    assert sweep.main(argv[:4] + ["--set", "parallel.x=3", "--nodes", "2"]) == 2
    assert "do not fit its grid" in capsys.readouterr().err
    spec.write_text(SPEC + '\n[slurm]\ngpus = 8\n')
    assert sweep.main([str(spec), "--list"]) == 2
    assert "unknown [slurm] key(s) ['gpus']" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# pieces


def test_time_limits_in_minutes():
    assert [slurm_options.minutes(v) for v in (90, "90", "12:00:00", "1:30", "1-12", "2-00:00:00", "0:00:01")] == \
        [90, 90, 720, 2, 2160, 2880, 1]


def test_shapes_follow_the_grid():
    opts = slurm_options.ClusterOptions(gpus_per_node=8, time=60)

    def shape(local=False, **parallel):
        return slurm_options.shape(from_dict({"parallel": parallel}), opts, local)

    assert shape(z=8) == slurm_options.Shape(1, 8, 8)
    assert shape(x=2, y=4, z=8) == slurm_options.Shape(8, 8, 8)
    assert shape(x=2) == slurm_options.Shape(1, 2, 2)  # less than a node: only the GPUs it uses
    assert shape(data=4, x=4) == slurm_options.Shape(2, 8, 8)
    assert shape(local=True, data=2, x=2) == slurm_options.Shape(1, 4, 4)


def test_a_requeued_job_resumes_from_its_checkpoint(tmp_path):
    job = slurm.TrainJob(["python", "-m", "memtrain", "train", "--out", str(tmp_path)], tmp_path)
    assert job.checkpoint().function.command[-1] == "--force"  # no checkpoint yet: start again, clean
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000010")
    again = job.checkpoint().function
    assert again.command == job.command + ["--resume"] and again.checkpoint().function.command == again.command
