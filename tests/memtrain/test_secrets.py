"""memtrain.secrets: what a W&B config or a sweep's record of its cluster keeps of a secret: nothing."""

from memtrain.secrets import REDACTED, redact, secret_key


def test_keys_named_for_a_secret_lose_their_values_and_other_keys_keep_theirs():
    assert [k for k in ("api_key", "WANDB_API_KEY", "hf_token", "password", "AWS_SECRET_ACCESS_KEY", "credentials",
                        "secret_groups", "tokenizer", "max_text_tokens", "random_format") if secret_key(k)] == [
        "api_key", "WANDB_API_KEY", "hf_token", "password", "AWS_SECRET_ACCESS_KEY", "credentials"]
    canaries = {"secret_groups": 4, "random_format": "secret"}
    got = redact({"wandb": {"api_key": "x", "project": "p"}, "canaries": canaries,
                  "nested": [{"WANDB_API_KEY": "y"}], "none": {"api_key": None}})
    assert got == {"wandb": {"api_key": REDACTED, "project": "p"}, "canaries": canaries,
                   "nested": [{"WANDB_API_KEY": REDACTED}], "none": {"api_key": None}}


def test_a_secret_assigned_inside_a_string_is_replaced():
    """A cluster's setup lines go into the sweep's W&B report config and sweep.json: `export NAME=value` keeps the
    line, loses the value, whatever its quotes; other assignments (a tokenizer path, a count of tokens) stay."""
    setup = ["export WANDB_API_KEY=SEKRIT1 HF_TOKEN='abc'", "module load cuda/12", "export OMP_NUM_THREADS=1",
             "data.tokenizer=/my/tok", "data.max_text_tokens=500"]
    got = redact({"slurm": {"setup": setup}})["slurm"]["setup"]
    assert got == [f"export WANDB_API_KEY={REDACTED} HF_TOKEN='{REDACTED}'", *setup[1:]]
    assert not any("SEKRIT1" in line or "abc" in line for line in got)
