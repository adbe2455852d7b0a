"""A stand-in SLURM on this machine: `sbatch`, `srun`, `sacct` and `squeue` scripts that do what the cluster's do
for one node, enough for submitit's SlurmExecutor and SlurmJob to submit, run and follow real jobs. sbatch runs the
script in the background with the job's SLURM_* variables; srun starts the job's tasks (SLURM_PROCID,
SLURM_LOCALID, ...) with their output in the --output/--error files; sacct and squeue read the state sbatch
recorded (squeue, as a cluster's after a few minutes, no longer lists an ended job). Without accounting, sacct
fails as on a cluster whose job accounting is off."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

SBATCH = '''
    import os, re, subprocess, sys
    from pathlib import Path
    state = Path(os.environ["FAKE_SLURM_STATE"])
    state.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[-1])
    text = script.read_text()
    d = dict(re.findall(r"^#SBATCH --([\\w-]+)=(\\S+)", text, re.M))
    job = str(len(list(state.glob("*.state"))) + int(os.environ.get("FAKE_SLURM_FIRST", "1000")))
    nodes, per_node = int(d.get("nodes", 1)), int(d.get("ntasks-per-node", 1))
    env = dict(os.environ, SLURM_JOB_ID=job, SLURM_NTASKS=str(nodes * per_node), SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_NTASKS_PER_NODE=str(per_node), SLURM_JOB_NODELIST="localhost")
    (state / f"{job}.state").write_text("RUNNING")
    (state / f"{job}.sbatch").write_text(text)
    out = d["output"].strip("'").replace("%j", job)
    err = d.get("error", d["output"]).strip("'").replace("%j", job)
    # the copy, as a cluster's sbatch runs: submitit deletes its submission file once sbatch has returned
    run = (f"bash {state}/{job}.sbatch >> {out} 2>> {err}; [ $? = 0 ] && s=COMPLETED || s=FAILED; "
           f"echo $s > {state}/{job}.state")
    subprocess.Popen(["bash", "-c", run], env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"Submitted batch job {job}")
'''

SRUN = '''
    import os, subprocess, sys
    args = sys.argv[1:]
    files = {}
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag in ("--output", "--error"):
            files[flag] = args.pop(0)
    job, n = os.environ["SLURM_JOB_ID"], int(os.environ["SLURM_NTASKS"])
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", n))
    procs = []
    for t in range(n):
        name = lambda f: f.replace("%j", job).replace("%t", str(t))
        out = open(name(files["--output"]), "a")
        err = open(name(files.get("--error", files["--output"])), "a")
        env = dict(os.environ, SLURM_PROCID=str(t), SLURM_LOCALID=str(t % per_node), SLURM_NODEID=str(t // per_node))
        procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=err))
    sys.exit(max(p.wait() for p in procs))
'''

SACCT = '''
    import os, sys
    from pathlib import Path
    state = Path(os.environ["FAKE_SLURM_STATE"])
    args = sys.argv[1:]
    jobs = [args[i + 1] for i, a in enumerate(args) if a == "-j"]
    print("JobID|State|NodeList")
    for job in jobs:
        f = state / f"{job}.state"
        if f.is_file():
            print(f"{job}|{f.read_text().strip()}|localhost")
    with open(state / "sacct.calls", "a") as calls:  # after the answer: a test can wait until the sweep has it
        calls.write(" ".join(jobs) + "\\n")
'''

NO_ACCOUNTING = '''
    import sys
    print("sacct: error: Slurm accounting storage is disabled", file=sys.stderr)
    sys.exit(1)
'''

SQUEUE = '''
    import os, sys, time
    from pathlib import Path
    args = sys.argv[1:]
    f = Path(os.environ["FAKE_SLURM_STATE"]) / f"{args[args.index('-j') + 1]}.state"
    if os.environ.get("FAKE_SQUEUE_SLOW"):  # a slow controller: the job ends while it is being asked
        for _ in range(600):
            if f.read_text().strip() not in ("PENDING", "RUNNING"):
                break
            time.sleep(0.1)
    state = f.read_text().strip() if f.is_file() else ""
    if state not in ("PENDING", "RUNNING"):
        print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
        sys.exit(1)
    print(state)
'''


def install(bin_dir: Path, accounting: bool = True) -> Path:
    """Write sbatch, srun, sacct and squeue into bin_dir (put it first on PATH; set FAKE_SLURM_STATE)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    sacct = SACCT if accounting else NO_ACCOUNTING
    for name, body in (("sbatch", SBATCH), ("srun", SRUN), ("sacct", sacct), ("squeue", SQUEUE)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
        path.chmod(0o755)
    return bin_dir
