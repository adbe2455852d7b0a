"""Cluster sweeps (experiments/sweep/slurm.py, jobs.py): every point one job through submitit. Here jobs run
through submitit's LocalExecutor (`--launcher submitit-local`, the same code path as SLURM) and through sbatch,
srun and sacct stand-ins. (The sbatch scripts and the cluster options: test_sbatch.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import textwrap
import threading
import time
from pathlib import Path

from experiments.sweep import cli, jobs
from experiments.sweep import spec as specs
from experiments.sweep.run import run_sweep
from experiments.sweep.slurm_options import ClusterOptions
from tests.experiments.sweep import _fake_slurm as fake_slurm
from tests.experiments.sweep._helpers import IDS, SPEC, launched, results, write_corpus
from tests.memtrain._helpers import TINY, stdlib_corpus

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
    summary = run_sweep(spec, out, launcher="submitit-local", cluster=ClusterOptions(poll_s=0.2),
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
    assert cli.main(argv) == 1
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
    assert cli.main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err

    before = (out / "results.jsonl").read_bytes()
    n = len(launched(env["log"]))
    os.environ["FAKE_FAIL"] = ""
    assert cli.main(argv + ["--resume"]) == 0
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
    assert cli.main(argv) == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2
    lost, removed = json.loads(lines[-1]), json.loads(lines[-2])
    (out / "results.jsonl").write_text("")
    shutil.rmtree(out / removed["point"])
    n = len(launched(env["log"]))
    assert cli.main(argv + ["--resume"]) == 0
    assert [x["name"] for x in launched(env["log"])[n:]] == [removed["point"]]
    rows = results(out)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert {r["point"] for r in rows} == {lost["point"], removed["point"]}
    again = {r["point"]: r["job"]["id"] for r in rows}
    assert again[lost["point"]] == lost["job"]["id"] and again[removed["point"]] != removed["job"]["id"]


def test_resume_waits_for_jobs_still_running_and_never_submits_them_twice(env, capsys, monkeypatch):
    out = env["tmp"] / "runs"
    release = env["tmp"] / "release"
    os.environ["FAKE_HOLD"] = str(release)  # the jobs end once the resuming sweep has found both running
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only", "ladder-1m",
            *LOCAL]
    assert cli.main(argv + ["--no-wait"]) == 0  # submitted; this "sweep" exits, the jobs go on
    printed = capsys.readouterr().out
    assert "2 queued, running or not yet submitted" in printed
    assert not (out / "results.jsonl").exists()
    ids = {pid: json.loads((out / pid / "job.json").read_text())["job_id"] for pid in IDS[:2]}
    real_pid_running, seen_running = jobs._pid_running, []

    def pid_running(pid: int) -> bool:  # the real check, counted
        alive = real_pid_running(pid)
        seen_running.append(alive)
        if sum(seen_running) == len(ids):
            release.touch()
        return alive

    monkeypatch.setattr(jobs, "_pid_running", pid_running)
    try:
        assert cli.main(argv + ["--resume"]) == 0
    finally:
        release.touch()
    printed = capsys.readouterr().out
    for pid, job_id in ids.items():
        assert f"{pid}: job {job_id} still queued or running: waiting for it" in printed
    assert len(launched(env["log"])) == 2  # each point ran once
    assert sorted((r["point"], r["job"]["id"]) for r in results(out)) == sorted(ids.items())


def test_a_controller_still_starting_counts_as_running():
    """What /proc says of a submitit-local job's pid. An empty command line is a process still starting: a --resume
    right after a --no-wait sweep once read it for the second job and ran that job again."""
    running = "Name:\tpython\nUmask:\t0022\nState:\tR (running)\n"
    controller = b"/usr/bin/python\0-m\0submitit.local._local\0/runs/p/submitit\0"
    assert jobs._is_controller(running, controller)
    assert jobs._is_controller(running, b"")  # still inside its start
    assert not jobs._is_controller(running.replace("R (running)", "Z (zombie)"), b"")
    assert not jobs._is_controller(running, b"/usr/bin/vim\0notes.txt\0")  # the pid went to another program
    assert not jobs._pid_running(os.getpid())  # pytest's own command line names no submitit


def _time_limit_warning(run_dir: Path, deadline_s: float = 120.0) -> list[int]:
    """Send a job's time-limit warning as soon as its trainer has saved a checkpoint: SIGUSR2 to every task of the
    job, what submitit's local controller does `signal_delay_s` (30 s) before the limit (Controller.wait in
    submitit/local/local.py), and SLURM's --signal on a cluster. Waiting for the event instead of the clock keeps
    a one-minute --time from costing 30 s. Returns the tasks signalled (filled in by a thread)."""
    signalled: list[int] = []

    def tasks_of(controller: int) -> list[int]:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == controller and b"submitit.core._submit" in cmdline:
                pids.append(int(stat.parent.name))
        return pids

    def warn() -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if (run_dir / "checkpoints" / "latest").is_file() and (run_dir / "job.json").is_file():
                tasks = tasks_of(int(json.loads((run_dir / "job.json").read_text())["job_id"]))
                if tasks:
                    for pid in tasks:
                        os.kill(pid, signal.SIGUSR2)
                    signalled.extend(tasks)
                    return
            time.sleep(0.05)

    threading.Thread(target=warn, daemon=True).start()
    return signalled


def test_a_job_at_its_time_limit_is_requeued_and_resumes_from_its_checkpoint(env):
    """--time 1 on submitit-local: the task is warned before the limit (as SLURM's --signal does, here as soon as
    the trainer has checkpointed: _time_limit_warning), and requeues the job with TrainJob.checkpoint(): the same
    command with --resume. The trainer, which ignores the warning, is stopped; the requeued job resumes and ends
    ok: one job, one result."""
    out = env["tmp"] / "runs"
    os.environ["FAKE_SLEEP"] = "300"  # longer than the limit: only the requeue can finish it
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only",
            "ladder-1m_standard", "--time", "1", *LOCAL]
    signalled = _time_limit_warning(out / "ladder-1m_standard")
    assert cli.main(argv) == 0
    assert len(signalled) == 1  # the job's one task was warned
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
    assert cli.main(argv + ["--no-wait"]) == 0
    printed = capsys.readouterr().out
    assert len(re.findall(r": job \d+ submitted", printed)) == 1 and "2 queued, running or not yet submitted" in printed
    assert cli.main(argv + ["--resume"]) == 0
    rows = results(out)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    second = json.loads((out / rows[1]["point"] / "job.json").read_text())["submitted"]
    assert rows[0]["finished"] <= second  # submitted once the first had ended


def test_base_models_are_pretrained_as_jobs_first(env, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", 12)
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
    assert cli.main(argv) == 0
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
    assert cli.main(argv) == 1
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
    assert cli.main(argv + ["--resume"]) == 0
    assert sorted(r["name"] for r in launched(env["log"])[n:]) == ["ladder-3m_standard"] * 2

    # a job still running when the sweep that submitted it is gone: --resume waits for it (sacct says RUNNING).
    # The job ends only once that sweep has asked sacct, however slow the machine (a fixed sleep raced it).
    release = env["tmp"] / "release"
    os.environ["FAKE_HOLD"] = str(release)
    other = env["tmp"] / "later"
    argv[argv.index("--out") + 1] = str(other)
    argv[argv.index("--only") + 1] = "ladder-10m_standard"
    assert cli.main(argv + ["--no-wait"]) == 0
    job_id = json.loads((other / "ladder-10m_standard" / "job.json").read_text())["job_id"]
    capsys.readouterr()
    calls = env["tmp"] / "slurm" / "sacct.calls"
    asked = calls.read_text().count("\n") if calls.exists() else 0
    releaser = threading.Thread(target=_release_after_sacct, args=(calls, asked, release), daemon=True)
    releaser.start()
    try:
        assert cli.main(argv + ["--resume"]) == 0
    finally:
        release.touch()
        releaser.join()
    assert f"job {job_id} still queued or running: waiting for it" in capsys.readouterr().out
    assert [r["job"]["id"] for r in results(other)] == [job_id]


def _release_after_sacct(calls: Path, asked: int, release: Path) -> None:
    """Let the held job end once sacct has been asked about it again (the resuming sweep saw it RUNNING)."""
    for _ in range(6000):
        if calls.exists() and calls.read_text().count("\n") > asked:
            break
        time.sleep(0.05)
    release.touch()


def test_without_job_accounting_a_job_that_died_without_its_result_is_not_waited_for(env, monkeypatch, capsys):
    """Where sacct refuses (job accounting off), submitit cannot tell a job that died before writing its result
    (here its task is killed, as a lost node would leave it) from one still running: squeue can, and the sweep
    records the point failed a few polls later instead of waiting forever; --resume runs it again."""
    fake_slurm.install(env["tmp"] / "bin", accounting=False)
    monkeypatch.setenv("PATH", f"{env['tmp'] / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_STATE", str(env["tmp"] / "slurm"))
    monkeypatch.setenv("FAKE_KILL", "ladder-1m_standard")
    monkeypatch.setenv("FAKE_KILL_MARK", str(env["tmp"] / "killed"))
    out = env["tmp"] / "runs"
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only",
            "ladder-1m_standard", "--launcher", "slurm", "--partition", "cpu", "--time", "5", "--gpus-per-node", "0",
            "--tasks-per-node", "1", "--nodes", "1", "--poll", "0.2"]
    t0 = time.time()
    assert cli.main(argv) == 1
    assert time.time() - t0 < 120, "the sweep waited for a job that had ended"
    (row,) = results(out)
    assert row["status"] == "failed" and "without writing its result" in row["error"], row["error"]
    assert "following jobs with squeue" in capsys.readouterr().out
    assert cli.main(argv + ["--resume"]) == 0
    assert [r["status"] for r in results(out)] == ["failed", "ok"]


def test_without_job_accounting_a_job_that_ends_while_squeue_is_asked_is_not_taken_for_lost(env, monkeypatch):
    """squeue is asked first and the result files after: a job that writes its result and ends between the two
    (here squeue answers only once the job has ended) is read as finished, not as lost without a result."""
    fake_slurm.install(env["tmp"] / "bin", accounting=False)
    monkeypatch.setenv("PATH", f"{env['tmp'] / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_STATE", str(env["tmp"] / "slurm"))
    monkeypatch.setenv("FAKE_SQUEUE_SLOW", "1")
    monkeypatch.setenv("FAKE_SLEEP", "1.5")  # its log file is then older than the sweep's grace for a lost job
    out = env["tmp"] / "runs"
    argv = [str(env["spec"]), "--out", str(out), "--runner", env["runner"], "--no-report", "--only",
            "ladder-1m_standard", "--launcher", "slurm", "--partition", "cpu", "--time", "5", "--gpus-per-node", "0",
            "--tasks-per-node", "1", "--nodes", "1", "--poll", "0.2"]
    assert cli.main(argv) == 0
    assert [r["status"] for r in results(out)] == ["ok"]
