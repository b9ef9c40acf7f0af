"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: intra-op threads only add overhead (10x on a loaded 2-core box). Restored
    after the module. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
