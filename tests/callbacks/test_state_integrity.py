"""Saved states carry a digest over their whole content: one flipped byte anywhere in a saved
file either fails to load or loads exactly what was saved, never other content (the monitor's
state, the gradient canaries' with their mechanism checks, the mechanism checks' own, the record
canaries'); a state without a digest, edited, or saved before states carried one is refused
with a message that says so; the Hugging Face adapter, which opens the file itself, names it."""

from __future__ import annotations

import io
import math
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import privmon
from privmon._digest import DIGEST_KEY, content_digest, digest, sealed
from privmon.audit import GradientCanaries, MechanismChecks, RecordCanaries
from privmon.queries import CallableQuery

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings(
        "ignore:Secure RNG",
        "ignore:Optimal order",
        "ignore:Full backward",
        "ignore:Detected pickle protocol",  # a flipped byte in the pickle's header
    ),
]


def _identical(a, b) -> bool:
    """Equal in type, structure and every byte (a tensor's dtype, shape and bytes; NaN equals
    NaN, -0.0 differs from 0.0): what "loaded the same content" means here."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        return bool(torch.equal(*as_bytes))
    if isinstance(a, float):
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or (a != a and b != b))
    return bool(a == b)


def _saved(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _flip_everywhere(blob: bytes, n: int, load_into):
    """Flip one byte (XOR 0xFF) at ``n`` positions spread over the whole file, one at a time;
    each corrupted file is loaded (``torch.load(weights_only=True)``, then ``load_into``, which
    returns what the object holds after loading). Counts: refused by torch.load, refused by
    the object, loaded the same content; and the positions that loaded other content."""
    original = torch.load(io.BytesIO(blob), weights_only=True)
    counts = {"torch.load": 0, "load_state_dict": 0, "identical": 0}
    changed = []
    for pos in np.linspace(0, len(blob) - 1, n).round().astype(int):
        damaged = bytearray(blob)
        damaged[pos] ^= 0xFF
        try:
            loaded = torch.load(io.BytesIO(bytes(damaged)), weights_only=True)
        except Exception:
            counts["torch.load"] += 1
            continue
        try:
            after = load_into(loaded)
        except ValueError:
            counts["load_state_dict"] += 1
            continue
        if _identical(loaded, original) and _identical(after, original):
            counts["identical"] += 1
        else:
            changed.append(int(pos))
    return counts, changed


# --- the monitor ----------------------------------------------------------------------------------
def _monitor():
    rng = np.random.default_rng(0)
    return privmon.PrivacyMonitor(
        CallableQuery(lambda b: torch.as_tensor(b), name="s"),
        [rng.normal(0.5, 1, 300)],
        [rng.normal(0, 1, 300)],
        every_n_steps=1,
        methods=("histogram",),
        early_stopping=privmon.PrivacyEarlyStopping("s/histogram", 0.9, use="value", patience=3),
    )


def test_a_flipped_byte_in_a_saved_monitor_state_never_loads_other_content():
    mon = _monitor()
    for step in (1, 2, 3):
        mon.step(step)
    blob = _saved(mon.state_dict())

    def load_into(state):
        fresh = _monitor()
        fresh.load_state_dict(state)
        return fresh.state_dict()

    counts, changed = _flip_everywhere(blob, 400, load_into)
    assert changed == []  # without the digest, 205 of these 400 loaded other content
    assert counts["load_state_dict"] > 50, counts  # the digest refused them: it was not idle
    assert sum(counts.values()) == 400


def test_a_monitor_state_edited_or_without_a_digest_is_refused_saying_so():
    mon = _monitor()
    mon.step(1)
    state = mon.state_dict()
    assert state[DIGEST_KEY] == content_digest(state) and state["state_version"] == 3
    fresh = _monitor()
    with pytest.raises(ValueError, match="state is damaged: what it holds no longer matches"):
        fresh.load_state_dict({**state, "run_id": "f" * 32})  # a plausible run id
    without = {k: v for k, v in state.items() if k != DIGEST_KEY}
    with pytest.raises(ValueError, match="state carries no digest"):
        fresh.load_state_dict(without)
    # a state of version 1, as privmon saved them before the digest
    with pytest.raises(ValueError, match=r"state_version 1 \(saved before states carried a dig"):
        fresh.load_state_dict({**without, "state_version": 1})
    # a state of version 2, as privmon saved them before the DP alarm had its own level and
    # before the loss traces
    drop = ("dp_alarm_delta", "loss_traces")
    two = {k: v for k, v in state.items() if k not in drop} | {"state_version": 2}
    with pytest.raises(
        ValueError,
        match=r"state_version 2 \(saved before the DP alarm had its own level, dp_alarm_delta: "
        r"its statistical tests spent interval_delta.*loss traces\).*reads state_version 3 only",
    ):
        fresh.load_state_dict(two)
    assert fresh.history == [] and fresh.n_certified_checks == 0  # nothing was applied
    fresh.load_state_dict(state)
    assert [r.step for r in fresh.history] == [1]


# --- the canaries and the mechanism checks --------------------------------------------------------
def _private(seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(200, 5, generator=g), torch.randint(0, 2, (200,), generator=g))
    model = nn.Linear(5, 2)
    model, opt, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.3),
        data_loader=DataLoader(data, batch_size=20),
        noise_multiplier=1.0,
        max_grad_norm=0.7,
    )
    return model, opt, loader


def _train(model, opt, loader, steps=6):
    for _, (x, y) in zip(range(steps), loader, strict=False):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_a_flipped_byte_in_a_gradient_canaries_state_never_loads_other_scores():
    model, opt, loader = _private()
    canaries = GradientCanaries(opt, 8, seed=4)  # with the mechanism checks: nested state
    _train(model, opt, loader)
    state = canaries.state_dict()
    assert "mechanism" in state and DIGEST_KEY in state["mechanism"]
    blob = _saved(state)
    _, fresh_opt, _ = _private()
    fresh = GradientCanaries(fresh_opt, 8, seed=4)

    def load_into(loaded):
        fresh.load_state_dict(loaded)
        return fresh.state_dict()

    counts, changed = _flip_everywhere(blob, 300, load_into)
    assert changed == []
    assert counts["load_state_dict"] > 30, counts
    edited = {**state, "scores": state["scores"] + 1.0}
    with pytest.raises(ValueError, match="GradientCanaries state is damaged"):
        fresh.load_state_dict(edited)
    with pytest.raises(ValueError, match="GradientCanaries state carries no digest"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != DIGEST_KEY})
    # the nested mechanism state is sealed on its own too: resealing the outer one is not enough
    nested = {**state["mechanism"], "steps": state["mechanism"]["steps"] + 1}
    with pytest.raises(ValueError, match="MechanismChecks state is damaged"):
        fresh.load_state_dict(sealed({**state, "mechanism": nested}))


def test_a_flipped_byte_in_a_mechanism_checks_state_never_loads_other_content():
    model, opt, loader = _private()
    checks = MechanismChecks(opt)
    _train(model, opt, loader)
    state = checks.state_dict()
    blob = _saved(state)
    _, fresh_opt, _ = _private()
    fresh = MechanismChecks(fresh_opt)

    def load_into(loaded):
        fresh.load_state_dict(loaded)
        return fresh.state_dict()

    counts, changed = _flip_everywhere(blob, 200, load_into)
    assert changed == [] and counts["load_state_dict"] > 10, counts


def test_a_flipped_byte_in_a_record_canaries_state_never_loads_other_values():
    canaries = RecordCanaries(30, seed=1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(100, 5, generator=g), torch.randint(0, 3, (100,), generator=g))
    torch.manual_seed(0)
    model = canaries.model(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)))
    model, opt, loader = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(canaries.dataset(data), batch_size=110),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    _train(model, opt, loader, steps=3)
    state = canaries.state_dict()
    assert bool(state["values"].abs().sum() > 0)  # the block moved: real values to protect
    blob = _saved(state)

    def load_into(loaded):
        fresh = RecordCanaries(30, seed=1)
        fresh.load_state_dict(loaded)
        return fresh.state_dict()

    counts, changed = _flip_everywhere(blob, 200, load_into)
    assert changed == [] and counts["load_state_dict"] > 20, counts
    with pytest.raises(ValueError, match="RecordCanaries state is damaged"):
        RecordCanaries(30, seed=1).load_state_dict({**state, "values": state["values"] * 2})


# --- the digest itself ----------------------------------------------------------------------------
def test_the_digest_tells_apart_what_a_load_could_confuse():
    base = {"a": 1, "b": [0.5, "x"], "t": torch.zeros(3)}
    variants = [
        {**base, "a": 1.0},  # int and float
        {**base, "a": True},  # int and bool
        {**base, "b": [0.5, "y"]},
        {**base, "b": [0.5]},
        {**base, "t": torch.zeros(3, dtype=torch.float64)},
        {**base, "t": torch.zeros(1, 3)},
        {**base, "t": torch.tensor([0.0, -0.0, 0.0])},  # one bit of one value
        {**base, "c": None},
        {"a": 1, "b": [0.5, "x"], 1: torch.zeros(3)},  # the key's type
    ]
    digests = {content_digest(v) for v in variants}
    assert len(digests) == len(variants) and content_digest(base) not in digests
    # equal content, equal digest: another dict order, a view, a copy on another tensor
    same = {"t": torch.arange(6.0)[::2].clone(), "b": [0.5, "x"], "a": 1}
    assert content_digest({**base, "t": torch.arange(6.0)[::2]}) == content_digest(same)
    assert digest(torch.arange(6.0)[::2]) == digest(torch.tensor([0.0, 2.0, 4.0]))


# --- a file privmon opens itself names it ---------------------------------------------------------
def test_the_trainer_callback_names_a_damaged_state_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    from privmon.integrations.transformers import STATE_FILE, PrivacyMonitorCallback

    mon = _monitor()
    mon.step(1)
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    path = folder / STATE_FILE
    state = mon.state_dict()
    torch.save({"global_step": 1, "monitor": {**state, "run_id": "0" * 32}}, path)
    callback = PrivacyMonitorCallback(_monitor(), log_to_trainer=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[])
    trainer_state = transformers.TrainerState(global_step=1)
    with pytest.raises(ValueError, match=rf"{os.path.basename(path)}.*state is damaged"):
        callback.on_train_begin(args, trainer_state, transformers.TrainerControl())
    path.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=rf"{STATE_FILE} cannot be read"):
        callback.on_train_begin(args, trainer_state, transformers.TrainerControl())
