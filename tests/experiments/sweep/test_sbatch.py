"""The sbatch scripts of cluster sweeps, checked directive by directive on the `paper` preset (`--launcher slurm
--dry-run`: no cluster needed), the cluster options' one-line errors, and the pieces: time limits, job shapes, the
requeued job's command. (Jobs that run: test_slurm.py.)"""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest

from experiments.sweep import cli, slurm_options
from experiments.sweep.jobs import TrainJob
from memtrain.config import from_dict
from tests.experiments.sweep._helpers import SPEC

# ---------------------------------------------------------------------------------------------------
# (c) the paper preset's sbatch scripts


def _scripts(text: str) -> dict[str, tuple[str, list[str]]]:
    parts = re.split(r"^#### (\S+): (.*)$", text, flags=re.M)[1:]
    return {parts[i]: (parts[i + 1], parts[i + 2].strip().splitlines()) for i in range(0, len(parts), 3)}


def test_paper_sbatch_scripts_checked_line_by_line(tmp_path, capsys):
    out = tmp_path / "paper"
    rc = cli.main(["paper", "--launcher", "slurm", "--dry-run", "--out", str(out), "--partition", "batch",
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
    assert cli.main(argv + ["--nodes", "2", "--time", "1-12:30"]) == 0  # data parallel fills 2 nodes
    (summary, lines), = _scripts(capsys.readouterr().out).values()
    assert summary.endswith("= 16 rank(s)") and "#SBATCH --nodes=2" in lines and "#SBATCH --time=2190" in lines
    assert cli.main(argv + ["--gpus-per-node", "0", "--tasks-per-node", "4"]) == 0
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
        rc = cli.main([str(env["spec"]), "--out", str(env["tmp"] / "runs"), *argv])
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
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "its grid (parallel.data=3 x=4 y=1 z=1) has 12 ranks, not a multiple of 8" in err
    assert cli.main(argv[:4] + ["--set", "parallel.x=3", "--nodes", "2"]) == 2
    assert "do not fit its grid" in capsys.readouterr().err
    spec.write_text(SPEC + '\n[slurm]\ngpus = 8\n')
    assert cli.main([str(spec), "--list"]) == 2
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
    job = TrainJob(["python", "-m", "memtrain", "train", "--out", str(tmp_path)], tmp_path)
    assert job.checkpoint().function.command[-1] == "--force"  # no checkpoint yet: start again, clean
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000010")
    again = job.checkpoint().function
    assert again.command == job.command + ["--resume"] and again.checkpoint().function.command == again.command
