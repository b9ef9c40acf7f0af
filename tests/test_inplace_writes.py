"""InPlaceWrites against torch's own version counter: seen exactly when it moves."""

import pytest
import torch

from privmon._inplace_writes import InPlaceWrites

WRITES = {
    "add_": lambda t: t.add_(1.0),
    "copy_ of the same values": lambda t: t.copy_(t.detach().clone()),
    "a view's mul_": lambda t: t[:2].mul_(2.0),
    "index assignment": lambda t: t.__setitem__(0, 5.0),
    "an SGD step": lambda t: torch.optim.SGD([t], lr=0.1).step(),
}
NO_WRITES = {
    "an out-of-place add": lambda t: t + 1.0,
    "a read": lambda t: float(t.sum()),
    "a write through .data": lambda t: t.data.add_(1.0),  # bypasses the counter, as documented
    "a clone's add_": lambda t: t.detach().clone().add_(1.0),
}


def _parameter() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.arange(4.0))
    p.grad = torch.ones(4)
    return p


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_an_in_place_write_is_seen_as_the_version_counter_sees_it(write):
    p = _parameter()
    seen = InPlaceWrites([torch.zeros(2), p])
    before = p._version  # the counter itself, the reference (privmon does not read it)
    with torch.no_grad():
        write(p)
    assert p._version > before
    assert seen.any()


@pytest.mark.parametrize("act", NO_WRITES.values(), ids=NO_WRITES.keys())
def test_anything_else_is_not_seen(act):
    p = _parameter()
    seen = InPlaceWrites([p])
    before = p._version
    with torch.no_grad():
        act(p)
    assert p._version == before
    assert not seen.any()


def test_a_witness_made_in_inference_or_no_grad_mode_still_sees_writes():
    p = _parameter()
    with torch.inference_mode():
        in_inference = InPlaceWrites([p])
    with torch.no_grad():
        in_no_grad = InPlaceWrites([p])
        p.add_(1.0)
    assert in_inference.any() and in_no_grad.any()
    assert not InPlaceWrites([p]).any()  # a new witness starts from the write


def test_an_inference_tensor_is_passed_by():
    with torch.inference_mode():
        t = torch.zeros(3)
    seen = InPlaceWrites([t, _parameter()])
    with torch.inference_mode():
        t.add_(1.0)
    assert not seen.any()
