import pytest
import torch

import gpsd
from gpsd._internal import memory_check


def test_the_check_asks_the_probe_for_the_bytes_it_needs(monkeypatch):
    # the probe collects garbage where less than the bytes wanted is free
    seen = []

    def free_memory_bytes(device, wanted=None):
        seen.append((torch.device(device), wanted))
        return wanted

    monkeypatch.setattr(memory_check, "free_memory_bytes", free_memory_bytes)
    x = torch.zeros(10, 2, dtype=torch.float32)
    memory_check.check_dense_matrices_fit("Model.fit", 3, x, torch.Size([2, 3]), "what", "advice")
    assert seen == [(torch.device("cpu"), 7200)]


def test_the_bytes_of_a_batch_of_matrices_are_checked_against_the_free_memory():
    x = torch.zeros(10, 2, dtype=torch.float32)
    batch = torch.Size([2, 3])
    # 3 matrices of 10 x 10 float32 (400 bytes each) for each of 6 problems: 7200 bytes
    with gpsd.settings.memory_limit(cpu=7200):
        memory_check.check_dense_matrices_fit("Model.fit", 3, x, batch, "what", "advice")
    with (
        gpsd.settings.memory_limit(cpu=7199),
        pytest.raises(gpsd.InsufficientMemoryError) as raised,
    ):
        memory_check.check_dense_matrices_fit("Model.fit", 3, x, batch, "the matrices", "do less")
    message = str(raised.value)
    assert message.startswith("Model.fit needs about 7200 bytes")
    assert "3 matrices of N x N = 10 x 10 in torch.float32 for each of 6 problems" in message
    assert "7199 bytes" in message and message.endswith("; do less")


def test_float64_matrices_take_eight_bytes_an_entry():
    x = torch.zeros(3, 10, 1, dtype=torch.float64)  # a batch of inputs: N is the rows
    with gpsd.settings.memory_limit(cpu=4 * 100 * 8 - 1):
        with pytest.raises(gpsd.InsufficientMemoryError, match="needs about 3200 bytes"):
            memory_check.check_dense_matrices_fit("Model.fit", 4, x, torch.Size(), "what", "advice")
