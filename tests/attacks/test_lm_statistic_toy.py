"""A new language-model statistic is one object registered in one place (issue #41): a toy
statistic defined here, the mean log-likelihood (the loss negated, higher for members), is
registered, computed by ``lm_statistic`` and ``LanguageModelQuery`` and checked against its
peer, the built-in loss. Nothing of privmon is patched; the registry is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privmon.attacks import lm_statistic
from privmon.attacks.language_model import STATISTICS
from privmon.attacks.lm_statistics import (
    LMStatistic,
    TokenInputs,
    register_lm_statistic,
    registered_lm_statistics,
    unregister_lm_statistic,
)
from privmon.queries import LanguageModelQuery


class LogLikelihood(LMStatistic):
    name, higher_is_member = "log_likelihood", True

    def score(self, inputs: TokenInputs) -> torch.Tensor:
        return -inputs.loss()


@pytest.fixture
def toy():
    before = registered_lm_statistics()
    register_lm_statistic(LogLikelihood())
    yield "log_likelihood"
    unregister_lm_statistic("log_likelihood")
    assert registered_lm_statistics() == before


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.embed(input_ids))


def test_a_registered_statistic_equals_its_peer(toy):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 9), generator=gen)
    logits = torch.randn(3, 9, 50, generator=gen)
    got = lm_statistic(logits, ids, statistic=toy)
    assert torch.equal(got, -lm_statistic(logits, ids, statistic="loss"))


def test_the_query_asks_the_statistic(toy):
    model = TinyLM()
    batch = {"input_ids": torch.randint(1, 20, (4, 6), generator=torch.Generator().manual_seed(1))}
    query = LanguageModelQuery(model, toy)  # type: ignore[arg-type]
    assert query.name == toy and query.higher_is_member is True
    assert torch.equal(query(batch), -LanguageModelQuery(model, "loss")(batch))


def test_the_built_in_statistics_stay(toy):
    assert toy not in STATISTICS
    with pytest.raises(ValueError, match="built-in"):
        unregister_lm_statistic("loss")
    with pytest.raises(ValueError, match="not yet registered"):
        register_lm_statistic(LogLikelihood())
