"""The Hugging Face adapter keeps the Trainer's own logs: a real ``Trainer`` on a tiny GPT-2
(built from a config, nothing downloaded), trained with and without privmon attached.

Training with the monitor is bit-identical to training without it, so every entry the Trainer
writes without privmon (loss, grad_norm, learning_rate, epoch, step) must be in ``log_history``
with privmon too, value for value, at every ``logging_steps`` whatever ``every_n_steps`` is; and
privmon's figures reach ``log_history`` and ``report_to`` (TensorBoard, read back) at its checks.
"""

from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator

import privmon
from privmon.queries import LanguageModelQuery

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it with PyTorch
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_STEPS = 40
AUC = "privacy/loss/auc"


def _privacy(entry):
    return any(k.startswith("privacy/") for k in entry)


def _train(tmp_path, *, logging_steps, every_n_steps=None, report_to=()):
    """Train a tiny GPT-2 for MAX_STEPS steps; attach a monitor when ``every_n_steps`` is
    given. Returns the trainer's ``log_history``."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(1, 20, (16, 6))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=2,
        logging_steps=logging_steps,
        report_to=list(report_to),
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=[{"input_ids": i, "labels": i} for i in ids[:8]]
    )
    if every_n_steps is not None:
        from privmon.integrations.transformers import attach

        monitor = privmon.PrivacyMonitor(
            LanguageModelQuery(model, "loss"),
            [{"input_ids": ids[:8]}],
            [{"input_ids": ids[8:]}],
            every_n_steps=every_n_steps,
            methods=("histogram",),
            strict=True,
        )
        attach(trainer, monitor, console="none")
    trainer.train()
    return trainer.state.log_history


def _trainer_entries(history):
    """The Trainer's own per-step entries (not privmon's, not the final train_runtime one)."""
    return [e for e in history if not _privacy(e) and "train_runtime" not in e]


@pytest.mark.parametrize(
    ("logging_steps", "every_n_steps"),
    [(10, 10), (10, 4), (5, 15)],
    ids=["equal", "checks-more-often", "checks-less-often"],
)
def test_the_trainers_own_log_entries_are_kept_at_every_logging_step(
    tmp_path, logging_steps, every_n_steps
):
    plain = _trainer_entries(_train(tmp_path / "plain", logging_steps=logging_steps))
    steps = list(range(logging_steps, MAX_STEPS + 1, logging_steps))
    assert [e["step"] for e in plain] == steps
    assert all({"loss", "grad_norm", "learning_rate", "epoch"} <= set(e) for e in plain)

    history = _train(tmp_path / "privmon", logging_steps=logging_steps, every_n_steps=every_n_steps)
    assert _trainer_entries(history) == plain  # every entry, value for value
    checks = list(range(every_n_steps, MAX_STEPS + 1, every_n_steps))
    assert [e["step"] for e in history if AUC in e] == checks
    assert not [e for e in history if _privacy(e) and "loss" in e]  # beside, never merged


def _event_steps(logdir):
    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_report_to_gets_the_trainers_loss_and_privmons_figures(tmp_path):
    _train(tmp_path, logging_steps=10, every_n_steps=4, report_to=["tensorboard"])
    (run_dir,) = (tmp_path / "runs").iterdir()  # TensorBoardCallback's default folder
    steps = _event_steps(run_dir)  # HF's TensorBoardCallback prefixes "train/"
    for tag in ("train/loss", "train/grad_norm", "train/learning_rate"):
        assert steps[tag] == [10, 20, 30, 40], tag
    assert steps[f"train/{AUC}"] == list(range(4, MAX_STEPS + 1, 4))
