"""Language-model membership statistics and secret-sharer exposure (privmon.attacks.language_model,
privmon.attacks.secret_sharer).

Every statistic of a padded Hugging Face batch (right and left padding, a real data collator, a
GPT-2 built offline from a config, a BPE tokenizer trained offline) is checked against a
straightforward per-text computation on the text alone, unpadded, in float64; the loss against
the model's own loss; exposure against brute-force ranks and scipy's normal distribution.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import scipy.stats as st
import torch
from conftest import byte_bpe_tokenizer, tiny_gpt2
from hypothesis import given, settings
from hypothesis import strategies as hs

from privmon.attacks import (
    causal_lm_logits,
    decode_texts,
    exposure,
    lm_statistic,
    lowest_k_mean,
    predicted_tokens,
    secret_sharer_canaries,
    sequence_losses,
    token_log_probs,
    token_z_scores,
    zlib_sizes,
)
from privmon.attacks.language_model import HIGHER_IS_MEMBER, STATISTICS

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CORPUS = [
    "Return the sum of two numbers.",
    "Open the file and return a stream.",
    "x",  # one token: nothing is predicted
    "Split the string at each separator.",
    "Sort the list in place, stably.",
    "Raise ValueError if the argument is negative; otherwise return its square root.",
    "Copy it.",
    "Return a new dictionary with the keys from the iterable and values set to value.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_bpe_tokenizer(CORPUS * 3)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_gpt2(tokenizer).double().eval()


def collate(tokenizer, texts, side):
    """A batch as the Trainer's data collator gives it (labels -100 at the padding)."""
    tokenizer.padding_side = side
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return collator([tokenizer(t) for t in texts])


def by_hand(model, tokenizer, text, k=0.2, first_unlabelled=0):
    """Every statistic of one text, unpadded, token by token (the papers' formulas)."""
    ids = tokenizer(text)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    lps, zs = [], []
    for t in range(1 + first_unlabelled, len(ids)):
        row = logp[t - 1]
        p = row.exp()
        mu = float((p * row).sum())
        var = float((p * row**2).sum()) - mu**2  # the paper's form
        lps.append(float(row[ids[t]]))
        zs.append((float(row[ids[t]]) - mu) / math.sqrt(var))
    n_low = int(len(lps) * k)
    loss = -sum(lps) / len(lps) if lps else math.nan
    return {
        "loss": loss,
        "zlib": loss / len(zlib.compress(text.encode("utf-8"))),
        "min_k": sum(sorted(lps)[:n_low]) / n_low if n_low else math.nan,
        "min_k_plus_plus": sum(sorted(zs)[:n_low]) / n_low if n_low else math.nan,
    }


def assert_same(got, want, tol=1e-9):
    got = np.asarray(got, dtype=float)
    want = np.asarray(want, dtype=float)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (got, want)
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=tol, atol=tol)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("chunk_tokens", [None, 1, 5])
def test_each_statistic_equals_the_per_text_formula_on_a_padded_batch(
    model, tokenizer, side, chunk_tokens
):
    batch = collate(tokenizer, CORPUS, side)
    mask = batch["attention_mask"]
    assert bool((mask == 0).any())  # the batch is padded on that side
    logits = causal_lm_logits(model, batch["input_ids"], mask)
    texts = decode_texts(tokenizer, batch["input_ids"], mask)
    assert texts == CORPUS  # the unpadded ids decode to the texts
    want = [by_hand(model, tokenizer, t) for t in CORPUS]
    for statistic in ("loss", "zlib", "min_k", "min_k_plus_plus"):
        got = lm_statistic(
            logits,
            batch["input_ids"],
            mask,
            statistic=statistic,
            labels=batch["labels"],
            texts=texts,
            chunk_tokens=chunk_tokens,
        )
        assert got.dtype == torch.float64 and got.shape == (len(CORPUS),)
        assert_same(got, [w[statistic] for w in want])
    # short texts, as MIMIR: T = 0 gives NaN everywhere, floor(0.2 T) = 0 NaN for Min-K
    assert math.isnan(want[2]["loss"]) and math.isnan(want[6]["min_k"])
    assert not math.isnan(want[6]["loss"])


def test_loss_equals_the_models_own_loss_per_text(model, tokenizer):
    batch = collate(tokenizer, CORPUS, "right")
    logits = causal_lm_logits(model, batch["input_ids"], batch["attention_mask"])
    got = lm_statistic(logits, batch["input_ids"], batch["attention_mask"], statistic="loss")
    for i, text in enumerate(CORPUS):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        if ids.shape[1] < 2:
            continue
        with torch.no_grad():
            own = model(ids, labels=ids).loss
        # (ForCausalLMLoss computes in float32 whatever the logits' dtype)
        assert float(got[i]) == pytest.approx(float(own), rel=1e-6)


def test_labels_set_to_minus_100_are_context_but_not_scored(model, tokenizer):
    batch = collate(tokenizer, CORPUS, "left")
    labels = batch["labels"].clone()
    for row, m in zip(labels, batch["attention_mask"], strict=True):
        first = int(m.nonzero()[0, 0])
        row[first : first + 3] = -100  # a "prompt" of three tokens
    logits = causal_lm_logits(model, batch["input_ids"], batch["attention_mask"])
    for statistic in ("loss", "min_k", "min_k_plus_plus"):
        got = lm_statistic(
            logits, batch["input_ids"], batch["attention_mask"], statistic=statistic, labels=labels
        )
        want = [by_hand(model, tokenizer, t, first_unlabelled=2)[statistic] for t in CORPUS]
        assert_same(got, want)


def test_reference_is_the_difference_of_the_two_losses(model, tokenizer):
    torch.manual_seed(1)
    config = model.config.__class__(**{**model.config.to_dict(), "n_layer": 1})
    reference = transformers.GPT2LMHeadModel(config).double().eval()
    batch = collate(tokenizer, CORPUS, "left")
    args = (batch["input_ids"], batch["attention_mask"])
    target_logits = causal_lm_logits(model, *args)
    ref_logits = causal_lm_logits(reference, *args)
    got = lm_statistic(target_logits, *args, statistic="reference", reference_logits=ref_logits)
    want = [
        by_hand(model, tokenizer, t)["loss"] - by_hand(reference, tokenizer, t)["loss"]
        for t in CORPUS
    ]
    assert_same(got, want)


def test_directions_and_k_one_is_minus_the_loss(model, tokenizer):
    assert set(HIGHER_IS_MEMBER) == set(STATISTICS)
    assert [s for s in STATISTICS if HIGHER_IS_MEMBER[s]] == ["min_k", "min_k_plus_plus"]
    batch = collate(tokenizer, CORPUS, "right")
    args = (batch["input_ids"], batch["attention_mask"])
    logits = causal_lm_logits(model, *args)
    loss = lm_statistic(logits, *args, statistic="loss")
    assert_same(lm_statistic(logits, *args, statistic="min_k", k=1.0), -loss, tol=1e-12)


def test_half_precision_logits_give_float32_scores_close_to_float64(model, tokenizer):
    batch = collate(tokenizer, CORPUS, "right")
    args = (batch["input_ids"], batch["attention_mask"])
    logits = causal_lm_logits(model, *args)
    for statistic in ("loss", "min_k_plus_plus"):
        exact = lm_statistic(logits, *args, statistic=statistic)
        half = lm_statistic(logits.to(torch.bfloat16), *args, statistic=statistic)
        assert half.dtype == torch.float32
        assert_same(half.double(), exact, tol=0.05)


def test_masked_vocabulary_entries_do_not_turn_z_scores_into_nan():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 10, dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 6))
    targets, counted = predicted_tokens(ids)
    masked = logits.clone()
    masked[..., 7:] = -math.inf  # three entries no token can take
    z = token_z_scores(masked, targets, counted)
    assert bool(torch.isfinite(z).all())
    assert_same(z, token_z_scores(logits[..., :7], targets, counted), tol=1e-12)
    lp = token_log_probs(masked, targets, counted)
    assert_same(lp, token_log_probs(logits[..., :7], targets, counted), tol=1e-12)


def test_a_prediction_with_constant_log_probabilities_has_no_z_score():
    logits = torch.tensor([[[0.0, -math.inf, -math.inf, -math.inf], [0.3, 0.1, -2.0, 1.0]]])
    logits = torch.cat([logits, torch.zeros(1, 2, 4)], dim=1).double()  # p = (1, 0, 0, 0), ...
    targets, counted = predicted_tokens(torch.tensor([[0, 0, 1, 2]]))
    z = token_z_scores(logits, targets, counted)
    assert math.isnan(float(z[0, 0])) and math.isfinite(float(z[0, 1]))
    assert math.isnan(float(z[0, 2]))  # uniform: sigma = 0 too
    assert math.isnan(float(lowest_k_mean(z, counted, k=1.0)[0]))


@settings(max_examples=60, deadline=None)
@given(
    rows=hs.lists(
        hs.lists(
            hs.tuples(hs.floats(-50, 5, allow_nan=False), hs.booleans()), min_size=1, max_size=12
        ),
        min_size=1,
        max_size=4,
    ),
    k=hs.sampled_from([0.1, 0.2, 0.25, 0.3, 0.5, 0.57, 0.7, 1.0]),
)
def test_lowest_k_mean_equals_sorted_slices(rows, k):
    width = max(len(r) for r in rows)
    values = np.zeros((len(rows), width))
    counted = np.zeros((len(rows), width), dtype=bool)
    for i, r in enumerate(rows):
        for j, (v, c) in enumerate(r):
            values[i, j], counted[i, j] = v, c
    got = lowest_k_mean(torch.from_numpy(values), torch.from_numpy(counted), k=k)
    for i in range(len(rows)):
        kept = sorted(values[i][counted[i]])[: int(len(values[i][counted[i]]) * k)]
        if kept:
            assert float(got[i]) == pytest.approx(np.mean(kept), rel=1e-12, abs=1e-12)
        else:
            assert math.isnan(float(got[i]))


def test_predicted_tokens_on_both_padding_sides():
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [0, 5, 6, 7, 0]])
    mask = ids != 0
    targets, counted = predicted_tokens(ids, mask)
    assert counted.tolist() == [
        [True, True, False, False],
        [False, False, True, True],
        [False, True, True, False],
    ]
    assert targets[counted].tolist() == [6, 7, 6, 7, 6, 7]


def test_bad_arguments_name_the_argument():
    ids = torch.tensor([[1, 2, 3]])
    logits = torch.zeros(1, 3, 5)
    for k in (0, 1.5, -0.1, math.nan, "a"):
        with pytest.raises(ValueError, match=r"k must be .*\(0, 1\]"):
            lm_statistic(logits, ids, statistic="min_k", k=k)
    with pytest.raises(ValueError, match="statistic must be one of"):
        lm_statistic(logits, ids, statistic="perplexity")
    with pytest.raises(ValueError, match="attention_mask row 0 has padding between tokens"):
        predicted_tokens(ids, torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="labels must have the shape of input_ids"):
        predicted_tokens(ids, labels=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=r"input_ids must be an integer array"):
        predicted_tokens(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 4\]"):
        lm_statistic(logits, torch.tensor([[1, 2, 9]]), statistic="loss")
    with pytest.raises(ValueError, match="do not match targets"):
        lm_statistic(torch.zeros(1, 4, 5), ids, statistic="loss")
    with pytest.raises(ValueError, match="'zlib' needs texts"):
        lm_statistic(logits, ids, statistic="zlib")
    with pytest.raises(ValueError, match="texts must hold 1 strings"):
        lm_statistic(logits, ids, statistic="zlib", texts=["a", "b"])
    with pytest.raises(ValueError, match="'reference' needs reference_logits"):
        lm_statistic(logits, ids, statistic="reference")
    with pytest.raises(ValueError, match="chunk_tokens must be an integer >= 1"):
        lm_statistic(logits, ids, statistic="loss", chunk_tokens=0)
    # a pad id outside the vocabulary is fine where it is not predicted
    got = lm_statistic(
        logits, torch.tensor([[1, 2, 99]]), torch.tensor([[1, 1, 0]]), statistic="loss"
    )
    assert float(got[0]) == pytest.approx(math.log(5))


def test_left_padding_needs_a_model_that_takes_positions():
    class NoPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 8)

        def forward(self, input_ids, attention_mask=None):
            return self.emb(input_ids)

    ids = torch.tensor([[0, 1, 2], [1, 2, 3]])
    assert causal_lm_logits(NoPositions(), ids, torch.ones_like(ids)).shape == (2, 3, 8)
    with pytest.raises(ValueError, match=r"left padded .* takes no position_ids"):
        causal_lm_logits(NoPositions(), ids, torch.tensor([[0, 1, 1], [1, 1, 1]]))


def test_zlib_sizes_and_decode():
    texts = ["abc" * 40, "the quick brown fox", ""]
    assert zlib_sizes(texts).tolist() == [len(zlib.compress(t.encode())) for t in texts]
    with pytest.raises(ValueError, match="texts must be a sequence of strings"):
        zlib_sizes("abc")


# --- exposure -------------------------------------------------------------------------------------


def test_rank_exposure_equals_the_brute_force_rank():
    rng = np.random.default_rng(0)
    candidates = rng.normal(size=999)
    canaries = np.array([-10.0, candidates[5], 0.0, 10.0])
    got = exposure(canaries, candidates)
    want = [math.log2(1000) - math.log2(1 + sum(c <= x for c in candidates)) for x in canaries]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert got[0] == pytest.approx(math.log2(1000))  # below every fill: the full log2|R|
    assert got[-1] == 0.0  # above every fill: rank |R|
    # one row per canary, a NaN candidate left out and a NaN canary kept aligned
    rows = np.tile(candidates, (2, 1))
    rows[1, 0] = np.nan
    got = exposure([0.0, np.nan], rows)
    assert got[0] == pytest.approx(want[2]) and math.isnan(got[1])


def test_gaussian_exposure_is_the_normal_tail_and_extrapolates_the_rank():
    rng = np.random.default_rng(1)
    space = rng.normal(3.0, 2.0, size=200_000)  # every fill of a space R, normal losses
    canaries = np.array([-6.0, -1.0, 1.0, 3.0])
    exact = exposure(canaries, space)
    sample = rng.choice(space, size=2000, replace=False)
    fitted = exposure(canaries, sample, method="gaussian")
    mu, sd = sample.mean(), sample.std(ddof=1)
    np.testing.assert_allclose(
        fitted, -st.norm.logcdf((canaries - mu) / sd) / math.log(2), rtol=1e-12
    )
    # the sample's rank saturates at log2(2001) ~ 11 bits; the fit reads the tail beyond it
    assert exposure(canaries[:1], sample)[0] == pytest.approx(math.log2(2001))
    np.testing.assert_allclose(fitted[1:], exact[1:], atol=0.15)
    assert fitted[0] > 11.5 and exact[0] > 11.5
    with pytest.raises(ValueError, match="method must be one of"):
        exposure(canaries, sample, method="skew")
    with pytest.raises(ValueError, match="one row per canary"):
        exposure(canaries, np.zeros((3, 5)))


def test_canaries_are_distinct_disjoint_seeded_and_exhaustive_when_asked():
    c = secret_sharer_canaries(n_canaries=20, length=6, n_candidates=500, seed=3)
    assert len(set(c.secrets)) == 20 and len(set(c.candidates)) == 500
    assert not set(c.secrets) & set(c.candidates) and not c.exhaustive
    assert all(len(s) == 6 and s.isdigit() for s in c.secrets + c.candidates)
    assert c.texts[0] == f"my secret number is {c.secrets[0]}" and c.space_size == 10**6
    assert c == secret_sharer_canaries(n_canaries=20, length=6, n_candidates=500, seed=3)
    small = secret_sharer_canaries("pin {secret}.", n_canaries=3, length=3, n_candidates=10**4)
    assert small.exhaustive and len(small.candidates) == 997
    assert sorted(small.candidates + small.secrets) == [f"{i:03d}" for i in range(1000)]
    with pytest.raises(ValueError, match="template must be a string holding"):
        secret_sharer_canaries("no placeholder")
    with pytest.raises(ValueError, match="alphabet must be"):
        secret_sharer_canaries(alphabet="aa")
    with pytest.raises(ValueError, match="n_canaries must leave room"):
        secret_sharer_canaries(n_canaries=10, length=1)


def test_sequence_losses_are_the_summed_token_losses_on_either_padding_side(model, tokenizer):
    texts = [t for t in CORPUS if len(tokenizer(t)["input_ids"]) > 1]
    for side in ("left", "right"):
        tokenizer.padding_side = side
        got = sequence_losses(model, tokenizer, texts, batch_size=3)
        want = [
            by_hand(model, tokenizer, t)["loss"] * (len(tokenizer(t)["input_ids"]) - 1)
            for t in texts
        ]
        np.testing.assert_allclose(got, want, rtol=1e-10)


# --- the query ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_model(model):
    torch.manual_seed(1)
    config = model.config.__class__(**{**model.config.to_dict(), "n_layer": 1})
    return transformers.GPT2LMHeadModel(config).double().eval()


@pytest.mark.parametrize("side", ["right", "left"])
def test_query_scores_each_text_as_the_formula_on_the_text_alone(
    model, tokenizer, reference_model, side
):
    from privmon.queries import LanguageModelQuery

    batch = collate(tokenizer, CORPUS, side)
    want = [by_hand(model, tokenizer, t) for t in CORPUS]
    ref = [by_hand(reference_model, tokenizer, t)["loss"] for t in CORPUS]
    for statistic in STATISTICS:
        query = LanguageModelQuery(model, statistic, tokenizer=tokenizer, reference=reference_model)
        assert query.name == statistic
        assert query.higher_is_member is HIGHER_IS_MEMBER[statistic]
        got = query(dict(batch))
        if statistic == "reference":
            assert_same(got, [w["loss"] - r for w, r in zip(want, ref, strict=True)])
            assert query.modules == (model, reference_model)
        else:
            assert_same(got, [w[statistic] for w in want])
            assert query.modules == (model,)
    # a transform: (x, labels) with x a mapping
    query = LanguageModelQuery(
        model,
        "min_k",
        k=0.5,
        name="mk50",
        transform=lambda b: ({"input_ids": b[0], "attention_mask": b[1]}, None),
    )
    got = query((batch["input_ids"], batch["attention_mask"]))
    assert_same(got, [by_hand(model, tokenizer, t, k=0.5)["min_k"] for t in CORPUS])


def test_queries_built_together_share_one_forward_per_batch_during_a_check(
    model, tokenizer, reference_model
):
    from privmon.queries import LanguageModelQuery, language_model_queries

    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        queries = language_model_queries(model, tokenizer=tokenizer, reference=reference_model)
        assert [q.name for q in queries] == list(STATISTICS)
        batches = [collate(tokenizer, CORPUS[:4], "left"), collate(tokenizer, CORPUS[4:], "left")]
        for q in queries:
            q.prepare()
        shared = [[q(dict(b)) for q in queries] for b in batches]
        for q in queries:
            q.release()
        assert len(calls) == len(batches)  # one forward per batch, not one per query
        calls.clear()
        for b, together in zip(batches, shared, strict=True):
            for statistic, got in zip(STATISTICS, together, strict=True):
                alone = LanguageModelQuery(
                    model, statistic, tokenizer=tokenizer, reference=reference_model
                )(dict(b))
                assert_same(got, alone, tol=0)
        assert len(calls) == len(batches) * len(STATISTICS)  # outside a check: no sharing
    finally:
        handle.remove()
    assert queries[0]._logits.logits is None  # released: nothing kept between checks
    alone = LanguageModelQuery(model, "loss")
    alone.prepare()
    alone(dict(batches[0]))
    assert alone._logits.logits is None  # a query built alone keeps no logits
    with pytest.raises(ValueError, match="statistics must be a non-empty subset"):
        language_model_queries(model, ["loss", "ppl"])


def test_query_configuration_is_checked_at_construction(model, tokenizer):
    from privmon.queries import LanguageModelQuery

    with pytest.raises(ValueError, match="statistic must be one of"):
        LanguageModelQuery(model, "ppl")
    with pytest.raises(ValueError, match=r"k must be in the interval \(0, 1\]"):
        LanguageModelQuery(model, "min_k", k=0)
    with pytest.raises(ValueError, match="'zlib' needs tokenizer="):
        LanguageModelQuery(model, "zlib")
    with pytest.raises(ValueError, match="'reference' needs reference="):
        LanguageModelQuery(model, "reference")
    with pytest.raises(ValueError, match=r"reference must be a torch\.nn\.Module"):
        LanguageModelQuery(model, "reference", reference="gpt2")
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        LanguageModelQuery("gpt2", "loss")
    with pytest.raises(ValueError, match="the batch has no input_ids"):
        LanguageModelQuery(model, "loss", transform=lambda b: ({"ids": b}, None))(
            torch.tensor([[1, 2]])
        )


def test_a_classifier_query_on_a_language_model_points_at_language_model_query(model):
    from privmon.queries import LossQuery

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match=r"\(2, 3, \d+\).*LanguageModelQuery"):
        LossQuery(model)({"input_ids": ids, "labels": ids})


def test_a_trainer_fine_tune_logs_every_statistic_through_the_trainer(tokenizer, tmp_path):
    """A real Trainer fine-tune (float32 GPT-2 from a config) with a monitor attached: each
    check's figures reach log_history, short texts are dropped and counted, and the console
    shows a headline line."""
    from privmon import PrivacyMonitor
    from privmon.integrations.transformers import attach
    from privmon.queries import language_model_queries

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2
    )
    model = transformers.GPT2LMHeadModel(config)
    members, nonmembers = CORPUS[:4], CORPUS[4:]
    tokenizer.padding_side = "right"
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    audit = [
        [collator([tokenizer(t) for t in members])],
        [collator([tokenizer(t) for t in nonmembers])],
    ]
    queries = language_model_queries(
        model, ["loss", "zlib", "min_k", "min_k_plus_plus"], tokenizer=tokenizer
    )
    monitor = PrivacyMonitor(queries, *audit, every_n_steps=4, methods=("histogram",))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=[tokenizer(t) for t in members],
        data_collator=collator,
    )
    attach(trainer, monitor)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "privacy/min_k/auc" in e]
    assert [e["step"] for e in logged] == [4, 8]
    for statistic in ("loss", "zlib", "min_k", "min_k_plus_plus"):
        assert f"privacy/{statistic}/histogram/lower" in logged[-1]
    # "x" (T = 0) is dropped everywhere; "Copy it." (T = 4) by Min-K% and Min-K%++ too
    assert logged[-1]["privacy/loss/n_dropped"] == 1
    assert logged[-1]["privacy/min_k/n_dropped"] == 2
    assert model.training  # the check left the model as it found it


# --- the example ----------------------------------------------------------------------------------


def test_lm_finetune_example_runs_offline_and_agrees_with_the_per_text_loop():
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",  # nothing may be downloaded
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "lm_finetune.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(
            r"\| (\w+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \[([\d.]+)\] \| ([\d.]+) \|", line
        )
        if m:
            rows[m.group(1)] = [float(v) for v in m.groups()[1:]]
    assert sorted(rows) == sorted(STATISTICS)
    for auc, auc_hand, adv, lower, adv_hand in rows.values():
        assert auc == pytest.approx(auc_hand, abs=0.0015)  # printed to 3 decimals
        assert adv == pytest.approx(adv_hand, abs=0.0015) and lower <= adv
    # the console got one short headline line per check, not every figure
    console = [ln for ln in proc.stdout.splitlines() if ln.startswith("{'privacy/")]
    assert len(console) == 1 and "plugin_upper" not in console[0]
    assert "exposure" in proc.stdout and "after, Gaussian fit" in proc.stdout
