"""The experiments layer on top of memtrain: memorization sweeps, their results and their report.

    sweep/       run a sweep's points (locally, under torchrun, or as SLURM jobs) and record each run
    results.py   the results file and the record of one run: the one schema sweep writes and report reads
    report/      report.md and figures, drawn from results.jsonl alone (no torch)
    bench/       benchmarks of the engine, the trainer and the decoder against their peers
    presets/     the shipped sweep specs

Imports run one way: sweep -> results <- report (sweep calls the report once its points have run; the report
never imports the sweep), and all of them -> memtrain. commands.py registers `memtrain sweep|plot|demo`.
"""
