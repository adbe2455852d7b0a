import torch

from eval.extraction import as_canary, extraction_eval
from eval.perplexity import validation_loss
from tests.eval._models import tiny_model


def _canaries(members, twins):
    rows = [{"tokens": t, "id": f"m{i}", "kind": "random", "copies": 1 + i % 2, "inserted": True}
            for i, t in enumerate(members)]
    rows += [{"tokens": t, "id": f"t{i}", "kind": "random", "copies": 0, "inserted": False}
             for i, t in enumerate(twins)]
    return rows


def test_memorized_sequences_are_extracted(memorized):
    model, members, twins, loss = memorized
    assert loss < 0.05
    res = extraction_eval(model, _canaries(members, twins), suffix_len=20, batch_size=3)
    agg = res.aggregates
    assert agg["by_membership"]["inserted"]["exact_match_rate"] == 1.0
    assert agg["by_membership"]["inserted"]["pythia_memorized_rate"] == 1.0
    assert agg["by_membership"]["twin"]["exact_match_rate"] == 0.0
    assert agg["by_membership"]["twin"]["token_match_mean"] < 0.2
    assert agg["by_copies"][2]["n"] == 2 and agg["by_copies"][0]["n"] == 4
    row = res.rows[0]
    assert row["generated"] == members[0][-20:] and row["rouge_l"] == 1.0 and row["longest_prefix"] == 20
    assert row["pythia_generated"] == members[0][32:64]


def test_untrained_model_extracts_nothing(memorized):
    _, members, _, _ = memorized
    res = extraction_eval(tiny_model("llama", seed=1, init_std=0.02), _canaries(members, []), suffix_len=20)
    assert res.aggregates["overall"]["exact_match_rate"] == 0.0
    assert res.aggregates["overall"]["token_match_mean"] < 0.2


def test_short_canaries_are_skipped_and_counted():
    model = tiny_model("llama", seed=2)
    canaries = [list(range(1, 52)), list(range(1, 51)), [7], list(range(1, 80))]
    res = extraction_eval(model, canaries, suffix_len=50, batch_size=2)
    assert res.skipped == {"suffix": 2, "pythia": 3}  # need 51 and 64 tokens
    assert [r["exact_match"] is None for r in res.rows] == [False, True, True, False]
    assert [r["pythia_score"] is None for r in res.rows] == [True, True, True, False]
    assert res.aggregates["overall"]["n_evaluated"] == 2
    assert len(res.rows[0]["generated"]) == 50
    assert extraction_eval(model, [[1, 2]], suffix_len=50).aggregates["overall"]["exact_match_rate"] is None


def test_as_canary_reads_dicts_and_objects():
    class Obj:
        token_ids = torch.tensor([4, 5, 6])
        id = "x"
        copies = 3
        role = "heldout"
    c = as_canary(Obj())
    assert c.tokens == [4, 5, 6] and c.copies == 3 and c.inserted is False
    assert as_canary({"ids": [1, 2], "split": "inserted"}).inserted is True


def test_validation_loss_matches_model_loss(memorized):
    model, members, twins, _ = memorized
    with torch.no_grad():
        want = float(model(input_ids=torch.tensor(twins), labels=torch.tensor(twins)).loss)
    got = validation_loss(model, twins, batch_size=3)
    assert abs(got["loss"] - want) < 1e-4 and got["tokens"] == 4 * 63
    assert validation_loss(model, members)["loss"] < got["loss"]
    # Ragged sequences weigh by tokens: total NLL over total predicted tokens.
    ragged = [twins[0][:5], twins[1], twins[2][:2]]
    with torch.no_grad():
        nll = [float(model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss) * (len(s) - 1)
               for s in ragged]
    got = validation_loss(model, ragged + [[3]], batch_size=2)  # a 1-token sequence has nothing to score
    assert got["tokens"] == 4 + 63 + 1 and got["sequences"] == 3
    assert abs(got["loss"] - sum(nll) / 68) < 1e-4
