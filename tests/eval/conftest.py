"""Shared fixtures for the eval tests."""

import pytest
import torch

from tests._helpers import once_per_session
from tests.eval._models import VOCAB, tiny_model, train_to_memorize


@pytest.fixture(scope="session")
def memorized(request):
    """A tiny Llama trained on 4 random 64-token sequences, plus 4 held-out twins of the same shape."""

    def compute():
        g = torch.Generator().manual_seed(123)
        members = torch.randint(0, VOCAB, (4, 64), generator=g).tolist()
        twins = torch.randint(0, VOCAB, (4, 64), generator=g).tolist()
        model = tiny_model("llama", seed=1, hidden=64, init_std=0.02)
        loss = train_to_memorize(model, members, steps=250)
        return model, members, twins, loss

    return once_per_session(request, compute)
