"""The model ladder: names, real shapes (exact published parameter counts), building, attention, errors."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

import parallel
from memtrain.hf import parallelize
from memtrain.model_copy import keep_model_dir, run_model_name, save_code
from memtrain.models import LADDER_VOCAB, build_model, get_config, list_models, param_count

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Parameter counts published for the real models (model cards / config arithmetic), tied weights once.
PUBLISHED = {
    "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400,
    "pythia-70m": 70_426_624, "pythia-160m": 162_322_944, "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632, "pythia-1.4b": 1_414_647_808, "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016, "pythia-12b": 11_846_072_320, "gpt2": 124_439_808,
}
LADDER = {"ladder-1m": 1e6, "ladder-3m": 3e6, "ladder-10m": 10e6, "ladder-30m": 30e6, "ladder-100m": 100e6}
WIDTHS = [f"width-{w}" for w in (32, 64, 128, 256, 384, 512)]


def test_names():
    names = list_models()
    assert set(PUBLISHED) | set(LADDER) | set(WIDTHS) | {"pythia-14m", "gpt2-tiny"} == set(names)


def test_width_ladder_scales_width_only():
    """The size study's ladder: depth, head size and MLP ratio fixed, only the width grows (54x in parameters
    at the quick preset's 2048-token vocabulary)."""
    cfgs = [get_config(name) for name in WIDTHS]
    assert {(c.num_hidden_layers, c.hidden_size // c.num_attention_heads) for c in cfgs[1:]} == {(2, 32)}
    assert all(abs(c.intermediate_size / c.hidden_size - 8 / 3) < 0.2 for c in cfgs)
    counts = [param_count(name, 2048) for name in WIDTHS]
    assert counts == sorted(counts) and counts[-1] > 50 * counts[0]
    assert param_count("width-384", 2048) > 30 * param_count("width-32", 2048)


@pytest.mark.parametrize("name", PUBLISHED)
def test_real_shapes_have_published_parameter_counts(name):
    assert param_count(name) == PUBLISHED[name]


@pytest.mark.parametrize("name", LADDER)
def test_ladder_sizes_and_divisibility(name):
    cfg = get_config(name)
    assert cfg.model_type == "llama" and cfg.vocab_size == LADDER_VOCAB and not cfg.tie_word_embeddings
    # Within 10% of the name at vocab 4096, and every size splits over 8 ranks on any axis.
    assert abs(param_count(name) / LADDER[name] - 1) < 0.1
    for size in (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size):
        assert size % 8 == 0, (name, size)


def test_real_hyper_parameters():
    llama = get_config("llama-3.1-405b")
    assert (llama.vocab_size, llama.num_key_value_heads, llama.hidden_size, llama.num_hidden_layers) == (
        128256, 8, 16384, 126)
    rope = llama.rope_parameters
    assert rope["rope_theta"] == 500000.0 and rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert not llama.tie_word_embeddings and llama.max_position_embeddings == 131072
    pythia = get_config("pythia-12b")
    assert pythia.vocab_size == 50688 and pythia.rope_parameters["partial_rotary_factor"] == 0.25
    assert pythia.use_parallel_residual and not pythia.tie_word_embeddings
    gpt2 = get_config("gpt2")
    assert gpt2.tie_word_embeddings and gpt2.vocab_size == 50257 and gpt2.attn_pdrop == 0.0


def test_build_from_config():
    a = build_model("ladder-1m", 1000, seed=1)
    b = build_model("ladder-1m", 1000, seed=1)
    c = build_model("ladder-1m", 1000, seed=2)
    assert a.config.vocab_size == 1000 and a.model.embed_tokens.weight.shape == (1000, 64)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    rng = torch.get_rng_state()
    build_model("gpt2-tiny")
    assert torch.equal(rng, torch.get_rng_state())  # the caller's generator is left alone
    small = build_model("gpt2", 300, n_layer=1)  # a local tokenizer of 300: GPT-2's eos 50256 cannot exist
    assert small.config.eos_token_id is None and small.config.n_layer == 1
    half = build_model("ladder-1m", dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16


# sdpa against eager attention, fp32 on a CPU: losses within 1e-6 relative, gradients within 1e-5 (norm of the
# difference over the norm; measured: losses equal, gradients 3e-7 apart), with rows of one document and rows
# packed with two (position_ids restarting: the block-diagonal mask of document attention).
@pytest.mark.parametrize("name, kw", [("ladder-1m", {}), ("pythia-14m", {"num_hidden_layers": 2}), ("gpt2-tiny", {})])
def test_models_use_sdpa_attention_equal_to_eager(name, kw):
    sdpa, eager = build_model(name, 512, **kw), build_model(name, 512, attn_implementation="eager", **kw)
    assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    packed = torch.cat([torch.arange(20), torch.arange(44)]).repeat(2, 1)
    for position_ids in (None, packed):
        losses, grads = [], []
        for model in (sdpa, eager):
            model.zero_grad()
            loss = model(ids, labels=ids, position_ids=position_ids).loss
            loss.backward()
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
        assert (grads[0] - grads[1]).norm() <= 1e-5 * grads[1].norm()
    # The engine keeps HF's attention modules: a parallelized model trains with the same implementation.
    plm = parallelize(build_model(name, 512, device="meta", **kw), parallel.Grid(1, 1, 1, 1), device="cpu")
    assert plm.config._attn_implementation == "sdpa"


def test_directories_get_sdpa_where_transformers_has_it(tmp_path):
    """A config-only directory of a Llama builds with sdpa; an architecture with no SDPA path in transformers
    (Bloom) keeps its eager attention instead of failing."""
    get_config("ladder-1m").save_pretrained(tmp_path / "llama")
    assert build_model(str(tmp_path / "llama")).config._attn_implementation == "sdpa"
    bloom = AutoConfig.for_model("bloom", vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
    bloom.save_pretrained(tmp_path / "bloom")
    assert build_model(str(tmp_path / "bloom")).config._attn_implementation == "eager"


def test_meta_builds_allocate_nothing():
    model = build_model("llama-3.1-70b", device="meta", dtype=torch.bfloat16)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_local_directory(tmp_path):
    model = build_model("gpt2-tiny", seed=4)
    model.save_pretrained(tmp_path)
    again = build_model(str(tmp_path))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    meta = build_model(str(tmp_path), device="meta")
    assert meta.memtrain_weights == str(tmp_path) and next(meta.parameters()).device.type == "meta"
    with pytest.raises(ValueError, match="the tokenizer has 5,000 tokens but model .* only 4,096 embedding rows"):
        build_model(str(tmp_path), vocab_size=5000)


def test_a_checkpoint_that_does_not_hold_its_model_whole_is_refused(tmp_path):
    """transformers fills what the files lack with a random init and goes on; a checkpoint whose config.json asks
    for another layer, or whose weights file is damaged, is one line naming the fix instead."""
    model = build_model("gpt2-tiny", seed=4)
    model.save_pretrained(tmp_path / "deeper")
    model.config.n_layer += 1
    model.config.save_pretrained(tmp_path / "deeper")
    with pytest.raises(ValueError, match=r"weights do not fit its config.json \(missing \['transformer.h.2"):
        build_model(str(tmp_path / "deeper"))
    model.save_pretrained(tmp_path / "noise")
    (tmp_path / "noise" / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="its weights do not load .*restore them"):
        build_model(str(tmp_path / "noise"))


def test_a_bf16_checkpoint_is_built_as_a_grid_builds_it(tmp_path):
    """In the default dtype on one process as on a grid (transformers' own default would keep it in bf16, so the
    same checkpoint would score differently there), its values exactly those saved."""
    model = build_model("gpt2-tiny", seed=4, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    one, meta = build_model(str(tmp_path)), build_model(str(tmp_path), device="meta")
    assert next(one.parameters()).dtype == next(meta.parameters()).dtype == torch.float32
    assert all(torch.equal(p.float(), q) for p, q in zip(model.parameters(), one.parameters()))


def test_a_checkpoint_refuses_a_tokenizer_it_was_not_trained_with(tmp_path):
    """A padded table passes (up to UNUSED_ROWS spare rows, as Pythia's); thousands of unused rows, or another EOS
    id, mean another tokenizer: one line naming the fix. A config-only directory is sized to the tokenizer."""
    build_model("ladder-1m", 4096, seed=0).save_pretrained(tmp_path / "ckpt")
    assert build_model(str(tmp_path / "ckpt"), vocab_size=4096 - 27).config.vocab_size == 4096
    with pytest.raises(ValueError, match=r"4,096 embedding rows but the tokenizer 512 tokens \(88% of the rows never "
                                         r"used\).*--set data.tokenizer="):
        build_model(str(tmp_path / "ckpt"), vocab_size=512)
    assert build_model(str(tmp_path / "ckpt")).config.eos_token_id == 2  # LlamaConfig's default
    with pytest.raises(ValueError, match="ends a text with token id 2 but the tokenizer's EOS is id 1"):
        build_model(str(tmp_path / "ckpt"), vocab_size=4096, eos_token_id=1)
    build_model("ladder-1m", 4096).config.save_pretrained(tmp_path / "arch")
    arch = build_model(str(tmp_path / "arch"), vocab_size=512, eos_token_id=1)
    assert (arch.config.vocab_size, arch.config.eos_token_id, arch.model.embed_tokens.weight.shape[0]) == (512, 1, 512)


def test_unknown_names_and_offline_hub(monkeypatch):
    with pytest.raises(ValueError, match="did you mean 'ladder-10m'"):
        build_model("ladder-10M")
    with pytest.raises(ValueError, match="did you mean 'llama-3.1-8b'"):
        build_model("lama-3.1-8b")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="'EleutherAI/pythia-70m' is not a named model nor a local directory.*offline"):
        build_model("EleutherAI/pythia-70m")


def test_a_runs_copy_of_its_model_directory_holds_every_code_file_auto_map_names(tmp_path):
    """The copy a run keeps (run_files.MODEL_DIR) and an export hold the Python files that config.json's auto_map
    names for every class (config, model, tokenizer), in the 'module.Class' and 'repo--module.Class' forms, those
    of tokenizer_config.json's auto_map, and what they import relatively; a 'repo--' reference to a copied file
    is made local, so the copy loads its own code offline. Files are only copied, never imported, and only from
    beside config.json (a crafted reference never reaches a file outside the directory)."""
    src = tmp_path / "custom"
    src.mkdir()
    auto_map = {"AutoConfig": "cfg.MyConfig", "AutoModelForCausalLM": "someone/repo--mod.MyModel",
                "AutoTokenizer": ["tok.MyTokenizer", None], "AutoProcessor": "../outside.Evil"}
    (src / "config.json").write_text(json.dumps({"model_type": "myllama", "auto_map": auto_map}))
    (src / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": [None, "tok2.Fast"]}}))
    for name, text in {"cfg.py": "", "mod.py": "from .helpers import f\n", "helpers.py": "", "tok.py": "",
                       "tok2.py": "", "unrelated.py": "", "model.safetensors": ""}.items():
        (src / name).write_text(text)
    (tmp_path / "outside.py").write_text("")
    code = {"cfg.py", "mod.py", "helpers.py", "tok.py", "tok2.py"}
    local = dict(auto_map, AutoModelForCausalLM="mod.MyModel")

    keep_model_dir(str(src), tmp_path / "run")
    kept = tmp_path / "run" / "model_dir"
    assert set(os.listdir(kept)) == code | {"config.json", "source.json"}
    assert json.loads((kept / "config.json").read_text())["auto_map"] == local
    assert json.loads((kept / "source.json").read_text())["weights"]  # model.safetensors: a checkpoint's config
    config = SimpleNamespace(auto_map=dict(auto_map))  # what export saves
    (tmp_path / "export").mkdir()
    save_code(str(src), config, tmp_path / "export")
    assert set(os.listdir(tmp_path / "export")) == code and config.auto_map == local
    keep_model_dir("ladder-1m", tmp_path / "named")  # a named model: nothing to keep
    assert not (tmp_path / "named").exists()


def test_a_run_builds_from_its_copy_as_it_trained_from_the_directory(tmp_path):
    """A checkpoint's copy keeps the checkpoint's table (the tokenizer may have up to UNUSED_ROWS fewer tokens) and
    builds with no weights of its own (the run's checkpoint holds them); an architecture's copy is sized to the
    tokenizer. A run without a copy builds from model.name, and its missing directory is named as such."""
    build_model("ladder-1m", 4096, num_hidden_layers=1).save_pretrained(tmp_path / "ckpt")
    build_model("ladder-1m", 4096, num_hidden_layers=1).config.save_pretrained(tmp_path / "arch")
    for name in ("ckpt", "arch"):
        keep_model_dir(str(tmp_path / name), tmp_path / f"run-{name}")
        shutil.rmtree(tmp_path / name)
    ckpt = run_model_name(tmp_path / "run-ckpt", str(tmp_path / "ckpt"))
    assert ckpt == str(tmp_path / "run-ckpt" / "model_dir")
    meta = build_model(ckpt, vocab_size=4096 - 27, device="meta")
    assert meta.config.vocab_size == 4096 and not hasattr(meta, "memtrain_weights")
    assert build_model(ckpt, vocab_size=4096 - 27).config.vocab_size == 4096  # no weights to load: the architecture
    arch = build_model(run_model_name(tmp_path / "run-arch", str(tmp_path / "arch")), vocab_size=512, device="meta")
    assert arch.config.vocab_size == 512
    assert run_model_name(tmp_path / "old", "ladder-1m") == "ladder-1m"
    with pytest.raises(FileNotFoundError, match=f"the run's model directory '{tmp_path}/gone' \\(model.name\\) no "
                                                "longer exists.*restore the directory"):
        run_model_name(tmp_path / "old", str(tmp_path / "gone"))
