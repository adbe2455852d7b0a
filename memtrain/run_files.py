"""The names of the files in a run directory: one list that the trainer, evaluation, export, the sweep and the
results reader all use (importable without torch, so `memtrain plot` starts fast).

    runs/my-run/
      config.toml          the resolved config (a recipe may also sit here before the run starts)
      run.json             grid, parameters, learning rate, precision, the stream's key, what was trained
      metrics.jsonl        one line per logged step
      passes.jsonl         the canaries scored after every pass (eval.every_pass)
      canaries.jsonl       the manifest: every canary copy's step, data-parallel rank, sequence and offset
      eval.json            the final evaluation's aggregates
      eval_canaries.jsonl  one row per canary and twin
      tokenizer/           the run's tokenizer, HF format
      checkpoints/         sharded safetensors checkpoints; `latest` names the newest complete one
      wandb/, wandb-run.json   the W&B mirror and the id that resumes it
"""

CONFIG = "config.toml"
RUN = "run.json"
METRICS = "metrics.jsonl"
PASSES = "passes.jsonl"
MANIFEST = "canaries.jsonl"
EVAL = "eval.json"
EVAL_CANARIES = "eval_canaries.jsonl"
TOKENIZER = "tokenizer"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
"""In checkpoints/: a file naming the newest complete checkpoint."""
WANDB = "wandb"
WANDB_RUN = "wandb-run.json"

OUTPUTS = (METRICS, PASSES, RUN, MANIFEST, EVAL, EVAL_CANARIES, CHECKPOINTS, TOKENIZER, WANDB, WANDB_RUN)
"""What a run writes (its config.toml aside: a recipe may sit in the directory it trains into)."""
