"""Secrets kept out of what memtrain writes or logs: W&B configs, a sweep's record of its cluster settings.

A safety net, not a vault: a key whose name says it holds a secret (api_key, WANDB_API_KEY, hf_token, password)
has its value replaced, and so does the value of NAME=value inside a string whose NAME says the same (a cluster's
setup line `export WANDB_API_KEY=...`).
"""

from __future__ import annotations

import re

REDACTED = "<redacted>"
_SECRET_WORDS = {"key", "token", "password", "passwd", "credentials", "apikey"}
_ASSIGNED = re.compile(r"\b([A-Za-z_][\w.]*)(\s*=\s*)(['\"]?)[^\s'\"]+\3")


def secret_key(name) -> bool:
    """Whether a key's name says it holds a secret: one of its words (WANDB_API_KEY: wandb, api, key) is one
    (secret_groups, a count of digit groups, and tokenizer are not)."""
    return bool(set(re.split(r"[^a-z0-9]+", str(name).lower())) & _SECRET_WORDS)


def redact(obj):
    """A copy of a config-like structure with secret-looking keys' values, and NAME=value secrets inside strings,
    replaced."""
    if isinstance(obj, dict):
        return {k: (REDACTED if secret_key(k) and v is not None else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return _ASSIGNED.sub(lambda m: f"{m[1]}{m[2]}{m[3]}{REDACTED}{m[3]}" if secret_key(m[1]) else m[0], obj)
    return obj
