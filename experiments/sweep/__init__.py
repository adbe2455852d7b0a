"""Memorization sweeps: one full run (fine-tune one pass, then evaluate) per point of a grid of configs.

    memtrain sweep quick                                  # a preset from experiments/presets/
    memtrain sweep my_sweep.toml --set train.lr=3e-4 --out runs/mine
    memtrain sweep quick --resume                         # run only points without a finished result
    memtrain sweep quick --list                           # print the points and exit
    memtrain sweep paper --launcher slurm --partition gpu # each point a SLURM job (slurm.py)
    python -m experiments.sweep quick ...                 # the same without the console script

A sweep spec is a TOML file:

    [sweep]
    name = "quick"                      # default --out is runs/<name>
    description = "..."
    keep_checkpoints = true             # false: delete each fine-tuned run's checkpoints once evaluated,
    keep_final_weights = "auto"         #   but its final weights (no optimizer state): true, false or "auto"
                                        #   (models up to 100M parameters), for `memtrain export`
    jobs = 1                            # points run side by side here (each with cores / jobs threads)

    [base]                              # a partial RunConfig: sections model, train, loss, data, ...
    data = { max_docs = 300, seq_len = 128 }

    [axes]                              # the grid is the product of every axis, in this order
    "model.name" = ["ladder-1m", "ladder-3m"]           # section.key = list of values
    loss = [{ kind = "standard" }, { kind = "goldfish", k = 4 }]   # section = list of tables
    seeds = [0, 1]                                      # shorthand for "train.seed"

    [pretrain]                          # the base model each fine-tuning run starts from
    steps = 200                         # 0: no pretraining (fine-tune from model.init or the seeded init)
    lr = 3e-3
    corpus = "disjoint"                 # see PretrainSpec

    [slurm]                             # defaults of --launcher slurm (its options win): see ClusterOptions
    gpus_per_node = 8
    time = "24:00:00"

Every point runs `python -m memtrain train --config RUN_DIR/config.toml --out RUN_DIR` (forked from a warm server
that imported it once, or under torchrun, or as a SLURM job) in its own directory <out>/<point-id>, and appends one
line to <out>/results.jsonl when it ends (experiments/results.py): its axes, status, run and base directories, the
eval.json contents, final training metrics and a compact per-canary list. The file is only ever appended to (and
flushed), never rewritten; a failed run is recorded with the last line of its stderr and the sweep goes on. The
report (experiments.report) is drawn from results.jsonl alone at the end, mirrored to a W&B run whose config is the
spec; with W&B offline, the sweep's last line is one `wandb sync` command for all its runs (points, report, base
models it pretrained).

Base models: a fine-tuning study needs a trained model to start from. Offline, the sweep pretrains one per model
size on a corpus WITHOUT canaries, cached under <cache>/base/<hash> (cache = data.cache_dir, $MEMTRAIN_CACHE or
~/.cache/memtrain) by a hash of everything that determines it, so later sweeps and other presets reuse it;
fine-tuning runs set model.init to it.

The modules, each importing only those below it (and experiments.results, memtrain; run.py also
experiments.report, to draw the report at the end):

    cli            memtrain sweep / demo: options, --list, --dry-run, then run_sweep
    run            the sweep: points left to run, the local loop (--jobs), cluster jobs, summary, report
    slurm          the points as cluster jobs: submit, wait, collect, --resume of jobs; --dry-run scripts
    point          a point's life: base model -> model.init -> run directory -> command -> record
    jobs           a command as a submitit job (SLURM or LocalExecutor); what its tasks run (no torch)
    base_models    pretrained base models, cached by what determines them
    spec           spec files and presets, expanded into points (points_of)
    slurm_options  cluster options, a job's shape (nodes x tasks) and sbatch script
    warm           the local launcher's runner: runs forked from a server that imported torch and memtrain once
    launch         command prefixes (local, torchrun, --runner), the run environment, the subprocess runner

This file imports nothing: every task of a cluster job imports the package to unpickle jobs.TrainJob.
"""
