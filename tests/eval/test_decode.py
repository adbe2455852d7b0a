import pytest
import torch

from eval.decode import HFStepper, greedy_decode, greedy_decode_batch, pad_left, sequence_logprobs
from tests.eval._models import tiny_model


def _prefixes(seed, n=6, lo=3, hi=17, vocab=256):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    lens[0], lens[1] = lo, hi - 1  # make sure the batch really is ragged
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


@pytest.mark.parametrize("arch", ["llama", "neox", "gpt2"])
def test_batch_equals_generate_with_mixed_lengths(arch):
    model = tiny_model(arch, seed=3)
    ids, mask = pad_left(_prefixes(7))
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)[:, ids.shape[1]:]
    ours = greedy_decode_batch(HFStepper(model), ids, mask, 12)
    assert ours.shape == (6, 12)
    assert torch.equal(ours, ref)
    # The check can fail: decoding without correct position ids gives different tokens.
    bad = greedy_decode_batch(_no_positions(model), ids, mask, 12)
    assert not torch.equal(bad, ref)


def _no_positions(model):
    """A stepper that forgets position ids (a classic left-padding bug)."""
    hf = HFStepper(model)

    def step(input_ids, attention_mask, position_ids, cache):
        return hf(input_ids, attention_mask, torch.zeros_like(position_ids), cache)
    step.new_cache = hf.new_cache
    return step


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_unpadded_batch_equals_generate(arch):
    model = tiny_model(arch, seed=4)
    ids = torch.randint(0, 256, (5, 9), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    assert torch.equal(greedy_decode_batch(HFStepper(model), ids, None, 10), ref[:, 9:])


def test_list_api_restores_order_and_matches_single_generate():
    model = tiny_model("llama", seed=5)
    prefixes = _prefixes(11, n=7)
    ours = greedy_decode(model, prefixes, 8, batch_size=3)
    for i, p in enumerate(prefixes):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
        assert ours[i].tolist() == ref[0, len(p):].tolist()


def test_plain_function_stepper_without_preallocation():
    model = tiny_model("neox", seed=6)
    hf = HFStepper(model, preallocate=False)
    calls = []

    def step(input_ids, attention_mask, position_ids, cache):
        calls.append(input_ids.shape[1])
        return hf(input_ids, attention_mask, position_ids, cache)

    prefixes = _prefixes(2, n=4)
    out = greedy_decode(step, prefixes, 5, batch_size=4)
    assert torch.equal(out, greedy_decode(model, prefixes, 5, batch_size=4))
    assert calls == [max(map(len, prefixes)), 1, 1, 1, 1]  # one prefill, then one token per step


def test_sequence_logprobs_and_stats_match_direct_computation():
    model = tiny_model("llama", seed=8)
    seqs = _prefixes(5, n=5, lo=2, hi=20)
    got = sequence_logprobs(model, seqs, batch_size=2, with_stats=True)
    for i, s in enumerate(seqs):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].double(), -1)
        want = logp.gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1)
        p = logp.exp()
        mu = (p * logp).sum(-1)
        sd = ((p * logp**2).sum(-1) - mu**2).sqrt()
        assert got.logprobs[i].shape == (len(s) - 1,)
        torch.testing.assert_close(torch.from_numpy(got.logprobs[i]), want, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.from_numpy(got.mean[i]), mu, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.from_numpy(got.std[i]), sd, atol=1e-4, rtol=0)


def test_stats_ignore_tokens_the_model_rules_out():
    """A -inf logit (a token the model masks) has probability 0: the Min-K%++ mean and spread are those of the
    other tokens, not nan (0 * -inf)."""
    logits = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(0))
    masked = torch.cat([logits, torch.full((1, 6, 1), float("-inf"))], dim=-1)
    seqs = [[1, 2, 3, 4, 5, 6]]
    want = sequence_logprobs(lambda ids: logits, seqs, with_stats=True)
    got = sequence_logprobs(lambda ids: masked, seqs, with_stats=True)
    for a, b in ((got.logprobs, want.logprobs), (got.mean, want.mean), (got.std, want.std)):
        torch.testing.assert_close(torch.from_numpy(a[0]), torch.from_numpy(b[0]), atol=1e-6, rtol=0)
