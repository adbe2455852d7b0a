"""Point digests and base-model keys hash what decides the trained weights only: how often a run logs and saves
(spec.BOOKKEEPING) and its W&B settings change neither, so changing them re-runs no point and pretrains no base
again; anything trained changes both. Digests made before the logging keys were left out stay valid for runs
that logged at the defaults."""

import hashlib
import json

import pytest

from experiments.sweep.base_models import base_key, pretrain_config
from experiments.sweep.spec import PretrainSpec, _digest
from memtrain.config import RunConfig, apply_overrides, from_dict

PRE = PretrainSpec(steps=20, corpus="same")


def _cfg(*overrides: str) -> RunConfig:
    return from_dict(apply_overrides({"data": {"max_docs": 10}}, list(overrides)))


def _base_key(cfg: RunConfig) -> str:
    return base_key(pretrain_config(cfg, PRE), "corpus-fingerprint", "tokenizer-fingerprint")


@pytest.mark.parametrize("change", ["train.log_every=50", "train.checkpoint_every=100",
                                    "train.checkpoint_every_min=5.0", "train.keep_checkpoints=10",
                                    "wandb.mode='offline'", "wandb.project='elsewhere'"])
def test_logging_and_saving_change_no_digest_and_no_base_key(change):
    assert _digest(_cfg(change), PRE) == _digest(_cfg(), PRE)
    assert _base_key(_cfg(change)) == _base_key(_cfg())


def test_a_number_written_as_an_integer_is_the_same_run():
    """lr = 1 in one spec and 1.0 in another: the same point, so --resume of a reformatted spec reruns nothing."""
    assert _digest(_cfg("train.lr=1", "train.min_lr=0"), PRE) == _digest(_cfg("train.lr=1.0", "train.min_lr=0.0"), PRE)


@pytest.mark.parametrize("change, pretrained", [("train.lr=0.002", False), ("train.seed=3", False),
                                                 ("train.batch_size=8", True), ("model.name='ladder-3m'", True),
                                                 ("data.seq_len=128", True)])
def test_what_is_trained_changes_them(change, pretrained):
    """Every fine-tuning setting changes the digest; the base key changes with those pretraining shares (its
    learning rate and seed are the [pretrain] section's own)."""
    assert _digest(_cfg(change), PRE) != _digest(_cfg(), PRE)
    assert (_base_key(_cfg(change)) != _base_key(_cfg())) == pretrained


def test_digests_of_runs_at_the_default_logging_are_those_made_before():
    """The formula before: the whole config without W&B, the cache location and checkpoint_every_min (and without
    keep_checkpoints, which did not exist)."""
    cfg = _cfg("train.seed=7")
    d = cfg.to_dict()
    d.pop("wandb")
    d["data"]["cache_dir"] = None
    for key in ("checkpoint_every_min", "keep_checkpoints"):
        d["train"].pop(key)
    before = hashlib.sha256(json.dumps({"config": d, "pretrain": None}, sort_keys=True).encode()).hexdigest()[:16]
    assert _digest(cfg, PretrainSpec()) == before
