"""Language-model statistics under careless input (issue #31: Broken 1, Partial 7, the
``return_dict=False`` hazard, the two mutants of ``attacks/language_model.py``).

A batch whose texts are all one token long (nothing to predict), a model on the meta device, a
model returning tuples, the default ``k`` and the default chunk's peak memory.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from privmon.attacks import (
    causal_lm_logits,
    lm_statistic,
    lowest_k_mean,
    predicted_tokens,
    sequence_losses,
    token_log_probs,
    token_z_scores,
)
from privmon.attacks.language_model import CHUNK_ELEMENTS, STATISTICS

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 20


def gpt2(seed: int = 0, **config) -> nn.Module:
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB, n_positions=32, n_embd=8, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**settings, **config})).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<pad>", *" abcdefghijklmnopqrs"])}
    chars = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    chars.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # a token a letter
    chars.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<pad>")


# --- Broken 1: a text with no predicted token -----------------------------------------------------


def test_a_batch_of_one_token_texts_scores_nan_for_every_statistic():
    """Was ``ValueError: targets is empty: shape (3, 0)`` for every statistic."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 1, 50, generator=gen)
    ids = torch.randint(0, 50, (3, 1), generator=gen)
    extra = {
        "zlib": {"texts": ["a", "b", "c"]},
        "reference": {"reference_logits": torch.randn(3, 1, 60, generator=gen)},
    }
    for statistic in STATISTICS:
        got = lm_statistic(logits, ids, statistic=statistic, **extra.get(statistic, {}))
        assert got.shape == (3,) and got.dtype == torch.float32, statistic
        assert bool(torch.isnan(got).all()), (statistic, got)
    # with a mask and labels too; float64 logits stay float64
    mask = torch.ones(3, 1)
    got = lm_statistic(logits.double(), ids, mask, labels=ids, statistic="loss")
    assert got.dtype == torch.float64 and bool(torch.isnan(got).all())
    # the per-token values: no column, not an error
    targets, counted = predicted_tokens(ids)
    assert targets.shape == counted.shape == (3, 0)
    assert token_log_probs(logits, targets, counted).shape == (3, 0)
    assert token_z_scores(logits, targets, counted, chunk_tokens=1).shape == (3, 0)
    # an empty batch or a text of no token stays an error naming the argument
    with pytest.raises(ValueError, match=r"input_ids is empty: shape \(3, 0\)"):
        lm_statistic(torch.randn(3, 0, 50), torch.zeros(3, 0, dtype=torch.long), statistic="loss")
    with pytest.raises(ValueError, match=r"input_ids is empty: shape \(0, 1\)"):
        lm_statistic(torch.randn(0, 1, 50), torch.zeros(0, 1, dtype=torch.long), statistic="loss")


def test_every_query_scores_a_batch_of_one_token_texts_nan(tokenizer):
    """The issue's reproduction: ``{"input_ids": [[5], [7]], "attention_mask": ones}``."""
    from privmon.queries import LanguageModelQuery, language_model_queries

    model, reference = gpt2(0), gpt2(1, n_layer=2)
    batch = {"input_ids": torch.tensor([[5], [7]]), "attention_mask": torch.ones(2, 1)}
    got = LanguageModelQuery(model, "loss")(batch)
    assert got.shape == (2,) and bool(torch.isnan(got).all())
    queries = language_model_queries(model, tokenizer=tokenizer, reference=reference)
    for q in queries:
        q.prepare()
    try:
        for q in queries:
            got = q(batch)
            assert got.shape == (2,) and bool(torch.isnan(got).all()), q.name
    finally:
        for q in queries:
            q.release()


def test_a_monitor_with_batch_size_one_drops_and_counts_a_one_token_member():
    """Batch size 1, one member text of one token: every check failed; now that record is
    dropped and counted, and the check's figures are there."""
    from privmon import PrivacyMonitor
    from privmon.queries import language_model_queries
    from privmon.report import tags

    model = gpt2(0)
    gen = torch.Generator().manual_seed(3)
    members = [{"input_ids": torch.tensor([[5]])}]  # one token: nothing to predict
    members += [{"input_ids": torch.randint(1, VOCAB, (1, 6), generator=gen)} for _ in range(7)]
    nonmembers = [{"input_ids": torch.randint(1, VOCAB, (1, 6), generator=gen)} for _ in range(8)]
    queries = language_model_queries(model, ["loss", "min_k", "min_k_plus_plus"], k=0.5)
    monitor = PrivacyMonitor(queries, members, nonmembers, every_n_steps=1, methods=("histogram",))
    report = monitor.check(1)
    assert report is not None and report.failures == {}, report and report.failures
    for q in ("loss", "min_k", "min_k_plus_plus"):
        assert report.scalars[tags.n_dropped(q)] == 1, q
        assert tags.query_figure(q, "histogram/lower") in report.scalars


def test_sequence_losses_of_a_one_token_text_is_nan_not_minus_zero(tokenizer):
    """Was -0.0, so such a canary ranked as fully memorised."""
    from privmon.attacks import exposure

    model = gpt2(0)
    for texts in (["a", "abc"], ["abc", "a"], ["a"]):  # padded beside a longer text, and alone
        got = sequence_losses(model, tokenizer, texts)
        one = texts.index("a")
        assert math.isnan(got[one]), got
        assert np.isfinite(np.delete(got, one)).all() and (np.delete(got, one) > 0).all()
    # such a canary gets no exposure, rather than the maximal one
    bits = exposure(sequence_losses(model, tokenizer, ["a"]), np.array([5.0, 6.0, 7.0]))
    assert math.isnan(bits[0])


# --- Partial 7: a model on the meta device --------------------------------------------------------


def test_a_model_on_the_meta_device_is_refused_at_construction_naming_the_device():
    from privmon.queries import LanguageModelQuery, language_model_queries

    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2)
        )
    with pytest.raises(ValueError, match=r"model .*on the meta device"):
        LanguageModelQuery(meta, "loss")
    with pytest.raises(ValueError, match=r"model .*on the meta device"):
        language_model_queries(meta, ["loss"])
    with pytest.raises(ValueError, match=r"reference .*on the meta device"):
        LanguageModelQuery(gpt2(0), "reference", reference=meta)
    with pytest.raises(ValueError, match=r"model .*on the meta device"):
        causal_lm_logits(meta, torch.tensor([[1, 2, 3]]))
    # a buffer alone on the meta device is refused too
    model = gpt2(0)
    model.register_buffer("scale", torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match=r"model has its buffer 'scale' on the meta device"):
        LanguageModelQuery(model, "loss")


# --- the hazard: Hugging Face return_dict=False ---------------------------------------------------


class TupleLM(nn.Module):
    """A model returning a tuple, as a Hugging Face model called with return_dict=False."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            return_dict=False,
        )


def test_tuple_outputs_are_read_as_the_logits_first():
    """``model(..., return_dict=False)`` gives ``(logits, cache)``: read its first element."""
    from privmon.queries import LanguageModelQuery

    model = gpt2(0)
    wrapped = TupleLM(model)
    ids = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # left padded: positions are passed
    assert isinstance(wrapped(ids, mask), tuple)
    torch.testing.assert_close(
        causal_lm_logits(wrapped, ids, mask), causal_lm_logits(model, ids, mask)
    )
    batch = {"input_ids": ids, "attention_mask": mask}
    for statistic in ("loss", "min_k", "min_k_plus_plus"):
        got = LanguageModelQuery(wrapped, statistic, k=0.5)(batch)
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, LanguageModelQuery(model, statistic, k=0.5)(batch))
    # a tuple whose first element is not the logits: the shape check says so
    with pytest.raises(ValueError, match=r"model returned logits of shape \(\)"):
        causal_lm_logits(lambda_module(lambda input_ids: (torch.tensor(1.0), input_ids)), ids)
    with pytest.raises(ValueError, match="model returned an empty tuple"):
        causal_lm_logits(lambda_module(lambda input_ids: ()), ids)
    # the statistics take such an output as logits too
    logits = torch.randn(2, 4, VOCAB, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        lm_statistic((logits, None), ids, statistic="min_k_plus_plus", k=0.5),
        lm_statistic(logits, ids, statistic="min_k_plus_plus", k=0.5),
    )
    with pytest.raises(ValueError, match="logits is an empty list"):
        lm_statistic([], ids, statistic="loss")


def lambda_module(fn) -> nn.Module:
    class Fn(nn.Module):
        def forward(self, input_ids):
            return fn(input_ids)

    return Fn()


def test_config_return_dict_false_fails_inside_transformers_and_the_error_says_why():
    """With ``config.return_dict = False`` a transformers 5 model fails inside its own forward
    (the base model returns a tuple that the head reads as an output object): the error names
    ``config.return_dict`` and the fix instead of transformers' AttributeError."""
    from privmon.queries import LanguageModelQuery

    model = gpt2(0, return_dict=False)
    ids = torch.tensor([[1, 2, 3]])
    try:
        out = model(ids)
    except AttributeError as e:  # transformers 5
        assert "tuple" in str(e)
        with pytest.raises(
            ValueError,
            match=r"model\.config\.return_dict is False.*set model\.config\.return_dict = True",
        ):
            causal_lm_logits(model, ids)
        with pytest.raises(ValueError, match=r"model\.config\.return_dict is False"):
            LanguageModelQuery(model, "loss")({"input_ids": ids})
        model.config.return_dict = True  # the fix the message gives
    else:  # transformers 4: a tuple, read as such
        assert isinstance(out, tuple)
    expected = LanguageModelQuery(gpt2(0), "loss")({"input_ids": ids})  # the same weights
    torch.testing.assert_close(LanguageModelQuery(model, "loss")({"input_ids": ids}), expected)


def test_another_failure_of_a_return_dict_false_model_is_not_blamed_on_return_dict():
    """Only transformers' tuple error is explained; any other error of the forward (a bug, out
    of memory) propagates as it is."""

    class Broken(torch.nn.Module):
        config = type("Config", (), {"return_dict": False})()

        def forward(self, **inputs):
            raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        causal_lm_logits(Broken(), torch.tensor([[1, 2, 3]]))


# --- the mutants of attacks/language_model.py -----------------------------------------------------


def test_the_default_k_is_the_papers_0_2():
    """⌊0.2 · 10⌋ = 2 lowest of 1..10: (1 + 2) / 2."""
    from privmon.queries import LanguageModelQuery, language_model_queries

    values = torch.arange(1.0, 11.0)[None]
    assert lowest_k_mean(values, torch.ones(1, 10, dtype=torch.bool)).tolist() == [1.5]
    logits = torch.randn(1, 11, 30, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(11)[None]
    for statistic in ("min_k", "min_k_plus_plus"):
        torch.testing.assert_close(
            lm_statistic(logits, ids, statistic=statistic),
            lm_statistic(logits, ids, statistic=statistic, k=0.2),
            rtol=0,
            atol=0,
        )
    assert LanguageModelQuery(gpt2(0), "min_k").k == 0.2
    assert {q.k for q in language_model_queries(gpt2(0), ["min_k", "min_k_plus_plus"])} == {0.2}


def test_the_default_chunk_is_2_to_the_22_elements(monkeypatch):
    """The vocabulary-wide work runs on blocks of ⌊2²²/V⌋ positions (whole records when they
    fit), never more."""
    blocks = []
    log_softmax = torch.log_softmax

    def spy(x, *args, **kwargs):
        blocks.append(tuple(x.shape))
        return log_softmax(x, *args, **kwargs)

    assert CHUNK_ELEMENTS == 2**22
    gen = torch.Generator().manual_seed(0)
    for vocab, n, length, want in [
        (2**18, 2, 20, [(1, 16, 2**18), (1, 4, 2**18)] * 2),  # 16 positions a block
        (50257, 1, 100, [(1, 83, 50257), (1, 17, 50257)]),
        (2**16, 3, 32, [(2, 32, 2**16), (1, 32, 2**16)]),  # 64 positions: two records a block
        (2**23, 1, 2, [(1, 1, 2**23)] * 2),  # V > 2²²: one position a block
    ]:
        blocks.clear()
        logits = torch.empty(n, length, vocab).normal_(generator=gen)
        ids = torch.randint(0, vocab, (n, length), generator=gen)
        monkeypatch.setattr(torch, "log_softmax", spy)
        lm_statistic(logits, ids, statistic="min_k_plus_plus")
        monkeypatch.setattr(torch, "log_softmax", log_softmax)
        assert blocks == want, (vocab, blocks)
        del logits


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, re, sys, torch
    from privmon.attacks import lm_statistic

    def status(key):
        with open("/proc/self/status") as f:
            return int(re.search(rf"^{key}:\\s+(\\d+) kB", f.read(), re.MULTILINE).group(1))

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 64, 262144, generator=gen)
    ids = torch.randint(0, 262144, (2, 64), generator=gen)
    lm_statistic(logits[:, :4], ids[:, :4], statistic="min_k_plus_plus")  # library state, once
    peaks = []
    for _ in range(2):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak-RSS mark back to the current RSS
        before = status("VmRSS")
        lm_statistic(logits, ids, statistic="min_k_plus_plus")
        peaks.append((status("VmHWM") - before) * 1024)
    print(json.dumps(max(peaks)))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_min_k_plus_plus_on_a_large_vocabulary_adds_two_chunks_at_peak():
    """Logits (2, 64, 262144) float32 (128 MiB): Min-K%++ adds at most 2·⌊2²²/V⌋·V·4 bytes =
    32 MiB (+ 1 MiB) at peak; without chunks it would add 256 MiB. Measured as
    benchmarks/lm_memory.py does: a child process whose large blocks glibc maps and unmaps."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("/proc/self/clear_refs is not writable")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    peak = int(proc.stdout.strip().splitlines()[-1])
    vocab = 262144
    bound = 2 * (2**22 // vocab) * vocab * 4
    assert peak <= bound + 2**20, f"{peak / 2**20:.1f} MiB added, bound {bound / 2**20:.1f} MiB"
