#!/usr/bin/env bash
# The GPU checks of the engine issue, in as few calls as a lent GPU's short lease allows. Run from the repository
# root on a machine with one CUDA GPU, after installing memtrain's dependencies; logs and JSON go to $OUT (else
# ./gpu_out). Where no package index is reachable, carry wheels of what the machine's image lacks (on 2026-11-28:
# datasets, dill, multiprocess, submitit, and transformers for the version tested here; wandb, whose own needs are
# many, is left out: W&B is off and `tests` skips what needs it), install them with --no-deps into a
# directory D, add memtrain itself there (`pip install --no-deps --no-build-isolation --target D .`: its CLI reads
# its own entry points) and run with PYTHONPATH=$PWD:D. Stages, in the order a lease should spend its minutes (name some to run only those):
#   bench  experiments.bench.train --device cuda: memtrain's single-GPU step vs a plain PyTorch loop on llama-3.2-1b
#          (bf16 autocast, fused AdamW, SDPA under document attention): MFU, paired ratio, peak memory, and one
#          profiled step of each side (where memtrain's 13% went on the H100, 2026-11-24)
#   compile the same with every transformer block torch.compile'd on both sides (train.compile; 4 warm-up steps
#          hold the compilations) and one profiled step of each: whether fused blocks move MFU towards the issue's
#          40% (eager: 25.6%, in today's FLOP count)
#   train  `memtrain train` on llama-3.2-1b, bf16, 12 steps, four ways: as is, train.optimizer_offload=true,
#          parallel.tune_matmul=true and train.compile=true; per run the median step time and MFU after the first
#          step (a compiled run's first two steps compile), and peak memory
#   tests  the engine and training tests on a machine whose GPU is visible (W&B's tests need wandb: left out)
#   demo   the main job (`python -m memtrain demo`, what `make TORCH=torch demo` runs once installed), timed
#   parity the demo's width-384 standard points (3 seeds) on the GPU and on this machine's CPU, same corpus, each
#          with its own cache (pretraining too): their one-exposure summaries side by side. On 2026-11-24 the GPU
#          demo (Python 3.12.3's stdlib, an earlier preset) gave negative one-exposure drops at every size; today's
#          preset gives positive ones on a CPU over 3.11.7's, 3.12.1's and 3.13.0's (experiments/robustness/):
#          this tells the device from the corpus
#   all    bench compile train tests (the default; demo takes a call of its own)
# On one H200 (2026-11-28) bench and compile took 75 and 70 s, tests 165 s (-n 8) and train 200 s: all four fit one
# call, with a ~35 s start.
set -u
out=${OUT:-gpu_out}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export MEMTRAIN_CACHE=${MEMTRAIN_CACHE:-/tmp/memtrain-cache}
py=${PYTHON:-python3}
stages=${*:-all}
[ "$stages" = all ] && stages="bench compile train tests"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, torch.cuda.get_device_name(0))" | tee -a "$out/gpu.txt"

summarize() {  # one line per run directory, from the sweep's own summary of a run (experiments.results)
    $py - "$@" <<'EOF'
import sys
from pathlib import Path
from experiments.results import train_summary
for d in sys.argv[1:]:
    s = train_summary(Path(d))
    if not s:
        print(f"{d}: no metrics (see its log)")
        continue
    step_s = s["tokens"] / s["step"] / s["tokens_per_s"]
    print(f"{d}: {s['step']} steps  step {step_s:.3f} s  MFU {s['mfu']:.3f}  "
          f"peak memory {s['memory_mb'] / 1024:.2f} GiB  (medians after the first step)")
EOF
}

for stage in $stages; do
    echo "=== $stage $(date -u +%T)"
    case $stage in
    bench)
        $py -m experiments.bench.train --device cuda --json "$out/bench_train.json" --profile "$out/profile" 2>&1 |
            tee "$out/bench_train.log" ;;
    compile)
        # no JSON (the log holds the table): `bench compile` in one call then brings back 8 files, the most a call can
        $py -m experiments.bench.train --device cuda --compile --warmup 4 --profile "$out/profile_compiled" 2>&1 |
            tee "$out/bench_compile.log" ;;
    train)
        mkdir -p /tmp/gpu_runs
        common=(--set model.name=llama-3.2-1b --set data.seq_len=1024 --set data.max_docs=600
                --set train.batch_size=8 --set train.max_steps=12 --set train.warmup_steps=2
                --set train.precision=bf16 --set eval.enabled=false --set wandb.mode=disabled)
        runs=()
        for variant in plain offload tuned compiled; do
            extra=()
            [ $variant = offload ] && extra=(--set train.optimizer_offload=true)
            [ $variant = tuned ] && extra=(--set parallel.tune_matmul=true)
            [ $variant = compiled ] && extra=(--set train.compile=true)
            # logs stay in /tmp unless a run fails: a call brings back at most 8 files
            $py -m memtrain train "${common[@]}" "${extra[@]}" --out "/tmp/gpu_runs/$variant" --force \
                > "/tmp/gpu_runs/$variant.log" 2>&1 ||
                { echo "$variant failed:"; cp "/tmp/gpu_runs/$variant.log" "$out/"; tail -5 "/tmp/gpu_runs/$variant.log"; }
            runs+=("/tmp/gpu_runs/$variant")
        done
        summarize "${runs[@]}" | tee "$out/train_summary.txt" ;;
    tests)
        no_wandb=(); $py -c "import wandb" 2>/dev/null ||
            no_wandb=(-k "not wandb" --ignore tests/memtrain/training/test_tracking.py
                      --ignore tests/memtrain/training/test_tracking_sync.py)
        timeout 420 $py -m pytest -q -n 8 -p no:cacheprovider --timeout 150 tests/parallel tests/memtrain/training \
            tests/experiments/bench/test_train_bench.py "${no_wandb[@]}" 2>&1 | tee "$out/tests.log" | tail -40 ;;
    demo)
        start=$(date +%s)
        $py -m memtrain demo > "$out/demo.log" 2>&1
        echo "demo exit $? after $(( $(date +%s) - start )) s"; tail -30 "$out/demo.log" ;;
    parity)
        for device in cuda cpu; do
            hide=(); [ $device = cpu ] && hide=(env CUDA_VISIBLE_DEVICES=)
            start=$(date +%s)
            MEMTRAIN_CACHE=/tmp/parity-cache-$device "${hide[@]}" $py -m memtrain demo --only width-384_standard \
                --out /tmp/parity/$device > "$out/parity_$device.log" 2>&1
            echo "$device: exit $? after $(( $(date +%s) - start )) s"
            cp /tmp/parity/$device/report.md "$out/parity_$device.md"
            grep -m1 "One exposure" /tmp/parity/$device/report.md | cut -c1-330
        done ;;
    *) echo "unknown stage $stage (bench, compile, train, tests, demo, parity, all)"; exit 2 ;;
    esac
done
