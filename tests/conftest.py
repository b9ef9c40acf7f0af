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


class RecordingSink:
    """A sink keeping every report as handed over: whole, at float64, with per-record arrays
    (the monitor's history keeps earlier checks' figures only, to float32 precision)."""

    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)

    def close(self):
        pass
