"""Fixtures shared by several test modules."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if os.environ.get("PRIVMON_REQUIRE_EXTRAS") == "1":
    # .ci/run installs every extra the tests use, so there an optional dependency that does not
    # import is a broken install (a floor too old for its own dependencies' newest releases, say),
    # never a missing one: pytest.importorskip imports, and the test fails with the ImportError a
    # user would see, instead of being skipped.
    _importorskip = pytest.importorskip

    def _import_or_fail(modname, *args, **kwargs):
        importlib.import_module(modname)
        return _importorskip(modname, *args, **kwargs)

    pytest.importorskip = _import_or_fail


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: intra-op threads only add overhead (10x on a loaded 2-core box). Restored
    after the module. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class RecordingSink:
    """A sink keeping every report as handed over: whole, at float64, with per-record arrays
    (the monitor's history keeps earlier checks' figures only, to float32 precision)."""

    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)

    def close(self):
        pass


def traced_run(sinks, *, writer=None, steps=6):
    """A small classifier trained ``steps`` steps on 60 of 120 records, a check every 2 steps,
    its per-sample losses recorded into a monitor's loss traces (``top_k`` 4); the monitor and
    every report, whole."""
    from privmon import PrivacyMonitor
    from privmon.callbacks import LossTracing
    from privmon.queries import LossQuery

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    x, y = torch.randn(120, 5), torch.randint(0, 2, (120,))
    members, nonmembers = [(x[:60], y[:60])], [(x[60:], y[60:])]
    keep = RecordingSink()
    monitor = PrivacyMonitor(
        LossQuery(model), members, nonmembers, every_n_steps=2, methods=("histogram",),
        writer=writer, sinks=[*sinks, keep], loss_traces=LossTracing(60, top_k=4),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(1, steps + 1):
        opt.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(x[:60]), y[:60], reduction="none")
        losses.mean().backward()
        opt.step()
        monitor.record_losses(torch.arange(60), losses, step=step)
        monitor.step(step)
    monitor.close()
    return monitor, keep.reports


def byte_bpe_tokenizer(texts, *, vocab_size=300):
    """A byte-level BPE tokenizer trained here on ``texts`` (``<pad>``, ``<eos>``), offline, as a
    ``transformers`` fast tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )


def tiny_gpt2(tokenizer):
    """A 2-layer GPT-2 of width 16 for ``tokenizer``, built from a config (seed 0)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_unet(*, conditional: bool = False, **config):
    """A random-weight diffusers UNet on 1×8×8 images, channels 8/16 (built in milliseconds):
    a ``UNet2DModel``, or with ``conditional`` a ``UNet2DConditionModel`` cross-attending to
    ``encoder_hidden_states`` of width 6. ``config`` adds to its configuration."""
    import diffusers

    common = {
        "sample_size": 8,
        "in_channels": 1,
        "out_channels": 1,
        "block_out_channels": (8, 16),
        "layers_per_block": 1,
        "norm_num_groups": 4,
        **config,
    }
    if conditional:
        return diffusers.UNet2DConditionModel(
            **common,
            cross_attention_dim=6,
            attention_head_dim=2,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )
    return diffusers.UNet2DModel(
        **common,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )
