"""Fixtures of the backend and kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Run the test with torch (and so the compiled CPU kernels) on this many threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
