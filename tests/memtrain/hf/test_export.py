"""`memtrain export` end to end, and an HF directory holding only config.json as `model.name`.

A tiny run is trained through the command line as a user would: 2 random and 2 document canaries at 2 and 8
copies, in a stream cut to 500 tokens of other text, so that most rows are canary copies and width-64
memorizes some of them in 30 passes (60 steps, seconds) while the twins stay unknown: a mixed result, so
exact match is not trivially all-False. The export is then loaded with transformers alone (offline, no
remote code) and `generate` (greedy) must give every evaluated canary and twin the same continuation, token
for token, as memtrain's own extraction wrote to eval_canaries.jsonl.

No float tolerance anywhere: exported weights are the checkpoint's tensors copied, so they compare bitwise;
generated tokens are argmaxes of the same fp32 model on the same context ([EOS] + the canary's prefix, what
memtrain feeds with document attention and canaries placed at row starts). The one difference is that
memtrain batches prefixes of unequal lengths with left padding while this test generates each one unpadded;
summation order may then differ in the last bits, which could only flip an argmax at a near-exact tie.
Seeded initializations are compared bitwise too: the same (seed, config) draws the same values.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memtrain.training.checkpoint import model_source
from parallel.forked import run_ranks
from tests.memtrain._helpers import ENV, ROOT, cli, memtrain, stdlib_corpus, write_recipe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = "width-64"


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    corpus = stdlib_corpus(tmp_path_factory.mktemp("corpus"), every=4, count=40, chars=6000)
    cache = tmp_path_factory.mktemp("cache")
    return write_recipe(tmp_path_factory.mktemp("recipe") / "memorize.toml", corpus, cache,
                        model={"name": MODEL}, train={"epochs": 30, "max_steps": None, "lr": 2e-2},
                        data={"max_text_tokens": 500}, canaries={"copies": [2, 8]})


@pytest.fixture(scope="module")
def run(recipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    r = memtrain("train", "--config", recipe, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    r = memtrain("export", run, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _final(run).name in r.stdout  # the newest checkpoint: the end of training
    return out


def _final(run: Path) -> Path:
    """The checkpoint of the run's last step (30 passes of its stream)."""
    return run / "checkpoints" / f"step_{json.loads((run / 'run.json').read_text())['trained']['steps']:06d}"


def _evaluated(run: Path, n: int):
    """Every row of eval_canaries.jsonl (canaries and twins) with its prefix and true suffix of n tokens."""
    manifest = {c["id"]: c for c in map(json.loads, (run / "canaries.jsonl").read_text().splitlines())}
    for line in (run / "eval_canaries.jsonl").read_text().splitlines():
        row = json.loads(line)
        canary = manifest[row["id"].removesuffix("-twin")]
        ids = canary["token_ids" if row["inserted"] else "twin_token_ids"]
        yield row, ids[:-n], ids[-n:]


def test_export_loads_offline_and_generate_reproduces_extraction(run, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(exported))
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    model.eval()

    # The run kept its tokenizer, and the export is that tokenizer with BOS = pad = its EOS, prepended.
    kept = AutoTokenizer.from_pretrained(run / "tokenizer", local_files_only=True)
    eos = kept.eos_token_id
    assert kept.get_vocab() == tok.get_vocab()
    assert tok.bos_token_id == tok.eos_token_id == tok.pad_token_id == eos
    assert model.config.bos_token_id == model.config.eos_token_id == model.config.pad_token_id == eos
    assert model.generation_config.eos_token_id == eos and not model.generation_config.do_sample
    assert tok("The secret code")["input_ids"][0] == eos

    # The weights are the latest checkpoint's, bit for bit.
    with model_source(_final(run)) as ckpt:
        state = model.state_dict()
        assert set(ckpt.keys()) == state.keys()
        assert all(torch.equal(ckpt.read(k), state[k]) for k in state)

    outcomes = []
    n = json.loads((run / "eval.json").read_text())["suffix_len"]
    for row, prefix, suffix in _evaluated(run, n):
        context = torch.tensor([[eos, *prefix]])
        with torch.no_grad():
            out = model.generate(context, attention_mask=torch.ones_like(context), max_new_tokens=n,
                                 do_sample=False)
        generated = out[0, context.shape[1]:].tolist()
        # generate stops at EOS (memtrain's extraction decodes all n tokens): compare what it produced.
        assert generated == row["generated"][:len(generated)], row["id"]
        assert len(generated) == n or generated[-1] == eos, row["id"]
        assert (generated == suffix) == row["exact_match"], row["id"]
        outcomes.append(row["exact_match"])
    assert len(outcomes) == 2 * 2 * 2  # 2 kinds x 2 canaries, each with its twin
    assert any(outcomes), "nothing memorized: the comparison would only ever see misses"
    assert not all(outcomes)


def test_export_of_a_checkpoint_replaces_an_earlier_export(run, exported):
    before = {name: (exported / name).read_bytes() for name in os.listdir(exported)}
    r = memtrain("export", _final(run), "--out", exported)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {name: (exported / name).read_bytes() for name in os.listdir(exported)} == before
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_large_models_export_in_shards(run, exported, tmp_path):
    """Over --max-shard-gb the weights go to HF's model-0000i-of-0000n files and index; from_pretrained loads
    them to the same tensors as the single-file export."""
    from transformers import AutoModelForCausalLM

    from memtrain.export import export

    export(run, tmp_path / "sharded", max_shard_bytes=300_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    single = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).state_dict()
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", local_files_only=True).state_dict()
    assert single.keys() == sharded.keys() and all(torch.equal(single[k], sharded[k]) for k in single)


def test_an_export_goes_through_a_link_and_over_an_earlier_export_in_other_shards(run, exported, tmp_path,
                                                                                   monkeypatch):
    """--out a link: its target gets the export and the link stays; a sharded export replaced by a single-file one
    (its weights only in other files) is an earlier export too; a checkpoint named from inside its run exports."""
    from memtrain.export import export

    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    export(run, tmp_path / "link", max_shard_bytes=300_000)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "model.safetensors.index.json").is_file()
    export(run, tmp_path / "link")
    assert sorted(os.listdir(tmp_path / "target")) == sorted(os.listdir(exported))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no aside copy left
    monkeypatch.chdir(_final(run).parent)
    assert export(_final(run).name, tmp_path / "again")[0] == _final(run)


@pytest.mark.parametrize("case", ["not a run", "out is a file", "weights deleted after evaluation"])
def test_bad_arguments_are_one_clear_line(run, tmp_path, case):
    if case == "not a run":
        (tmp_path / "notes.txt").write_text("hello")
        args, expect = [tmp_path, "--out", tmp_path / "hf"], "neither a run directory"
    elif case == "weights deleted after evaluation":  # what a sweep with keep_final_weights = false leaves
        shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints"))
        assert (tmp_path / "run" / "eval.json").is_file()
        args, expect = [tmp_path / "run", "--out", tmp_path / "hf"], f"`memtrain train --config {tmp_path}/run/"
    else:
        (tmp_path / "file").write_text("")
        args, expect = [run, "--out", tmp_path / "file"], "is a file"
    r = cli("export", *args)  # in this process, as a new one
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memtrain: error:") and expect in lines[0], r.stderr[-2000:]


def _initial_weights(rank, world, recipe, names):
    import parallel
    from memtrain.config import load
    from memtrain.training import setup

    out = []
    for name in names:
        _, plm = setup(load(recipe, [f"model.name={name}"]), parallel.Grid(1, 1, 1, 1))
        out.append(plm.full_state_dict())
    return out


def test_config_only_directory_trains_from_the_seeded_init(recipe, run, tmp_path):
    from transformers import AutoTokenizer

    from memtrain.models import get_config

    vocab = len(AutoTokenizer.from_pretrained(run / "tokenizer", local_files_only=True))
    config_dir = tmp_path / "config-only"
    get_config(MODEL, vocab_size=vocab).save_pretrained(config_dir)
    assert os.listdir(config_dir) == ["config.json"]

    # Trains (and is evaluated: the single-process evaluation model is built from the directory too).
    out = tmp_path / "run"
    r = memtrain("train", "--config", recipe, "--out", out, "--set", f"model.name={config_dir}",
                 "--set", "train.max_steps=1", "--set", "train.epochs=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "checkpoints" / "step_000001" / "model-00000.safetensors").is_file()
    assert json.loads((out / "eval.json").read_text())["n_evaluated"] == 2 * 2

    # Its initialization is memtrain's seeded one of the named model it describes.
    from_dir, named = run_ranks(1, _initial_weights, recipe, [str(config_dir), MODEL])[0]
    assert from_dir.keys() == named.keys()
    assert all(torch.equal(from_dir[k], named[k]) for k in named)


_CFG = "from transformers import LlamaConfig\n\n\nclass MyConfig(LlamaConfig):\n    model_type = 'myllama'\n"
_MOD = ("from transformers import LlamaForCausalLM\n\nfrom .cfg import MyConfig\n\n\n"
        "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n")
_CHECK = """
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from memtrain.config import load
from memtrain.evaluate import run_model
from memtrain.export import run_tokenizer
from memtrain.training.checkpoint import latest, read_weights
export, run = sys.argv[1], Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, local_files_only=True).eval()
cfg = load(run / "config.toml")
tok = run_tokenizer(run, cfg)
with read_weights(latest(run)) as src:
    trained = run_model(cfg, len(tok), {k: src.read(k) for k in src.keys()}, run).eval()
context = torch.tensor([tok("def main():\\n    return")["input_ids"]])
kw = dict(attention_mask=torch.ones_like(context), max_new_tokens=8, do_sample=False, min_new_tokens=8)
same = [torch.equal(model.generate(context, **kw), trained.generate(context, **kw))]
same += [torch.equal(v, trained.state_dict()[k]) for k, v in model.state_dict().items()]
print(json.dumps({"class": type(model).__name__, "same": all(same)}))
"""


def test_an_export_of_a_model_with_its_own_code_loads_and_generates_as_the_run(recipe, tmp_path):
    """A --trust-remote-code model's export holds every code file its config.json's auto_map names, so it loads
    with transformers (trust_remote_code=True) as the directory's own class and generates what the run's model
    generates. Before, it held cfg.py (config.save_pretrained copies the config class's file) but not mod.py:
    from_pretrained failed with "does not appear to have a file named mod.py". In new processes, with
    transformers' module cache kept here."""
    from memtrain.models import get_config

    custom = tmp_path / "custom"  # an architecture (config only), with its own config and model classes
    custom.mkdir()
    (custom / "cfg.py").write_text(_CFG)
    (custom / "mod.py").write_text(_MOD)
    config = dict(get_config(MODEL).to_dict(), model_type="myllama",
                  auto_map={"AutoConfig": "cfg.MyConfig", "AutoModelForCausalLM": "mod.MyModel"})
    (custom / "config.json").write_text(json.dumps(config))
    env = dict(ENV, HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "hf_modules"))

    def run(*argv):
        r = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    out, exported = tmp_path / "run", tmp_path / "export"
    run("-m", "memtrain", "train", "--config", recipe, "--out", out, "--set", f"model.name={custom}",
        "--set", "train.max_steps=2", "--set", "train.epochs=1", "--set", "eval.enabled=false", "--trust-remote-code")
    run("-m", "memtrain", "export", out, "--out", exported, "--trust-remote-code")
    assert {"cfg.py", "mod.py"} <= set(os.listdir(exported))
    assert json.loads((exported / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == "mod.MyModel"
    assert json.loads(run("-c", _CHECK, exported, out).splitlines()[-1]) == {"class": "MyModel", "same": True}
