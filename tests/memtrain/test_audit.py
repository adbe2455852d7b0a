"""`memtrain eval --model DIR --canaries FILE`: a model memtrain never trained (a small Llama fitted here with plain
torch on some of the canaries), scored against a plain transformers computation: greedy `generate` for every
suffix and a teacher-forced forward for every log-probability; the same under torchrun on a 2-rank grid."""

import json
import shutil
import subprocess

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from memtrain.audit import audit
from memtrain.scoring import start_ids

from ._helpers import CPU_RANKS, ROOT, cli, memtrain, refused
from .test_cli import TORCHRUN

SEEN = ["Jane Roe's card number is 4111 1111 1111 1111.", "The vault opens with 7731-0042 on Tuesdays.",
        "Mira Olsen lives at 12 Harbour Road, Leith."]
UNSEEN = ["John Doe's card number is 5500 0000 0000 0004.", "The vault opens with 1290-8817 on Fridays.",
          "Ivo Brandt lives at 9 Mill Lane, Perth."]
SUFFIX = 6


def _tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(SEEN + UNSEEN, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Llama of 2 layers fitted for 150 steps on SEEN, each after the EOS, saved with save_pretrained."""
    tok = _tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = LlamaForCausalLM(config)
    rows = [[tok.eos_token_id, *tok(t, add_special_tokens=False)["input_ids"]] for t in SEEN]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.eos_token_id] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def canary_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("canaries") / "secrets.jsonl"
    lines = [{"id": f"pii-{i}", "kind": "pii", "text": s, "twin": u} for i, (s, u) in enumerate(zip(SEEN, UNSEEN))]
    lines.append({"id": 17, "kind": "split", "prefix": "The vault opens with", "suffix": " 7731-0042 on Tuesdays."})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def one_process(model_dir, canary_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("audit") / "one"
    r = memtrain("eval", "--model", model_dir, "--canaries", canary_file, "--out", out, "--suffix-len", SUFFIX)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, out


def _rows(out):
    return [json.loads(x) for x in (out / "eval_canaries.jsonl").read_text().splitlines()]


def test_every_canary_equals_plain_transformers(model_dir, one_process):
    """Exact match and generated ids equal `generate` (greedy) from the same prefix; each row's mean log-probability
    equals a teacher-forced forward's within 1e-5 (the evaluation pads and batches; the reference runs each alone)."""
    r, out = one_process
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = _rows(out)
    assert [x["id"] for x in rows] == ["pii-0", "pii-0-twin", "pii-1", "pii-1-twin", "pii-2", "pii-2-twin", 17]
    split_prefix = len(tok("The vault opens with", add_special_tokens=False)["input_ids"])
    texts = dict(zip(["pii-0", "pii-1", "pii-2"], SEEN)) | dict(zip(["pii-0-twin", "pii-1-twin", "pii-2-twin"], UNSEEN))
    texts[17] = "The vault opens with 7731-0042 on Tuesdays."
    exact = 0
    for row in rows:
        body = (tok("The vault opens with", add_special_tokens=False)["input_ids"]
                + tok(" 7731-0042 on Tuesdays.", add_special_tokens=False)["input_ids"]) if row["id"] == 17 \
            else tok(texts[row["id"]], add_special_tokens=False)["input_ids"]
        ids = [tok.eos_token_id, *body]  # no BOS added by this tokenizer: the EOS opens the text
        cut = 1 + split_prefix if row["id"] == 17 else len(ids) - SUFFIX
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids[:cut]]), max_new_tokens=len(ids) - cut, do_sample=False,
                                 min_new_tokens=len(ids) - cut, pad_token_id=tok.eos_token_id)[0, cut:].tolist()
            logits = model(torch.tensor([ids])).logits[0, :-1]
        logprob = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
        assert row["generated"] == gen, row["id"]
        assert row["exact_match"] == (gen == ids[cut:]), row["id"]
        assert row["suffix_len"] == len(ids) - cut
        assert row["loss"] == pytest.approx(logprob, abs=1e-5), row["id"]
        exact += bool(row["inserted"] and row["exact_match"])
    result = json.loads((out / "eval.json").read_text())
    assert result["exact_count"] == exact and exact >= 2  # the fitted model gives back what it saw
    assert result["by_kind"]["pii"]["twins_exact_count"] == 0
    assert result["by_kind"]["pii"]["mia_auc_loss"] == 1.0  # seen texts are far likelier than their twins
    assert "pii" in r.stdout and "split" in r.stdout and "exact match" in r.stdout  # the table per kind


def test_on_a_two_rank_grid_equals_one_process(model_dir, canary_file, one_process, tmp_path):
    """Under torchrun the model is sharded (x=2) and each rank loads only its slices of the safetensors: every
    generated id equal, log-probabilities within 1e-5 relative (sharded sums run in another order)."""
    _, one = one_process
    out = tmp_path / "grid"
    r = subprocess.run([*TORCHRUN, "eval", "--model", str(model_dir), "--canaries", str(canary_file), "--out",
                        str(out), "--suffix-len", str(SUFFIX), "--set", "parallel.x=2"], capture_output=True, text=True,
                       env=CPU_RANKS, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("exact match") == 1  # the table, from rank 0 only
    assert json.loads((out / "eval.json").read_text())["world_size"] == 2
    for x, y in zip(_rows(one), _rows(out), strict=True):
        assert (y["id"], y["generated"], y["exact_match"]) == (x["id"], x["generated"], x["exact_match"])
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)


def test_start_token_is_bos_when_the_tokenizer_adds_one():
    assert start_ids(_tokenizer(bos=True)) == [0]
    assert start_ids(_tokenizer(bos=False)) == [1]


def test_bad_canary_file_is_one_line(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    r = cli("eval", "--model", model_dir, "--canaries", bad, "--out", tmp_path / "o")  # in this process: fails early
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"memtrain: error: canary file {str(bad)!r} line 2 has unknown keys "
                                             "['txt']: use only ['copies', 'id', 'kind', 'prefix', 'suffix', 'text', "
                                             "'twin']"]
    assert not (tmp_path / "o").exists()


def test_a_memtrain_run_is_a_model_too(tiny_run, canary_file, tmp_path):
    """--model RUN: the run's tokenizer and checkpoint, each canary read after the run's EOS as it trains them."""
    r = memtrain("eval", "--model", tiny_run.out, "--canaries", canary_file, "--out", tmp_path / "o",
                 "--suffix-len", SUFFIX)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "o" / "eval.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny_run.out / "tokenizer")
    assert result["start_ids"] == [tok.eos_token_id] and result["n_evaluated"] == 4
    assert [x["id"] for x in _rows(tmp_path / "o")][-1] == 17


def test_a_directory_named_like_a_built_in_model_is_that_directory(model_dir, canary_file, tmp_path, monkeypatch,
                                                                    one_process):
    """`--model ladder-1m` where ./ladder-1m is the user's model: their weights, not a random built-in ladder-1m
    (the tokenizer was read from the directory either way)."""
    shutil.copytree(model_dir, tmp_path / "ladder-1m")
    monkeypatch.chdir(tmp_path)
    audit("ladder-1m", str(canary_file), "o", [f"eval.suffix_len={SUFFIX}"])
    assert _rows(tmp_path / "o") == _rows(one_process[1])


def test_an_out_that_cannot_be_made_is_told_before_the_model_is_scored(model_dir, canary_file, tmp_path):
    """--out below a file (as below a read-only directory): one line before any scoring, not after it."""
    (tmp_path / "f").write_text("a file")
    r = cli("eval", "--model", model_dir, "--canaries", canary_file, "--out", tmp_path / "f" / "o")
    assert r.returncode == 2 and "Not a directory" in r.stderr and "eval: extraction" not in r.stderr


def test_a_grid_asked_for_without_its_processes_is_refused(model_dir, canary_file, tmp_path):
    """`--set parallel.x=2` on one process scored on that one process and reported world_size 1, the grid asked
    for silently dropped: the line names the torchrun command instead (a run's own grid, from its config.toml, is
    not asked for: `eval RUN` on one process stays allowed)."""
    r = cli("eval", "--model", model_dir, "--canaries", canary_file, "--out", tmp_path / "o", "--set", "parallel.x=2")
    line = refused(r, "--set parallel.x asks for a grid of 2 processes, and this is one")
    assert "torchrun --nproc-per-node 2 -m memtrain eval" in line and not (tmp_path / "o" / "eval.json").exists()
