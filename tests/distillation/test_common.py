"""The one check of ``noise`` that every distiller uses, at construction and on assignment."""

import numpy as np
import pytest
import torch
from gpr_reference import rbf_kernel

from gpsd import DataCentricGPC, DataCentricGPR, DistributionCentricGPR
from gpsd.distillation._common import check_noise

DT = torch.float64
LIKE = torch.zeros(3, 1, dtype=DT)


def _data(n=20):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=gen, dtype=DT) * 4
    y = torch.sin(2 * x.squeeze(-1))
    return x, y, (y > 0).to(DT)


@pytest.mark.parametrize(
    ("noise", "num_steps", "expected"),
    [
        (0.5, 3, [0.5, 0.5, 0.5]),
        (0.5, None, [0.5]),
        (torch.tensor(0.5), 2, [0.5, 0.5]),
        (np.float64(0.5), 2, [0.5, 0.5]),
        ([0.1, 0.2], None, [0.1, 0.2]),
        (np.array([0.1, 0.2]), 2, [0.1, 0.2]),
    ],
)
def test_one_value_is_every_steps_and_a_schedule_is_taken_as_given(noise, num_steps, expected):
    got = check_noise(noise, LIKE, num_steps, owner="M", positive=True, batch=True)
    assert got.dtype == DT and got.tolist() == expected


def test_a_batch_of_schedules_is_kept_where_the_family_takes_one():
    batch = torch.full((2, 3), 0.1, dtype=DT)
    got = check_noise(batch, LIKE, 3, owner="M", positive=True, batch=True)
    assert got.shape == (2, 3)
    with pytest.raises(ValueError, match=r"for M, which fits one schedule .* got shape \(2, 3\)"):
        check_noise(batch, LIKE, 3, owner="M", positive=False, batch=False)


def test_a_family_that_needs_positive_noise_says_so():
    with pytest.raises(ValueError, match=r"finite numbers > 0 for M \(every step's posterior"):
        check_noise([0.1, 0.0], LIKE, owner="M", positive=True, batch=True)
    assert check_noise([0.1, 0.0], LIKE, owner="M", positive=False, batch=False).tolist() == [
        0.1,
        0.0,
    ]
    for bad in ([0.1, -0.1], [float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="finite numbers >= 0, got"):
            check_noise(bad, LIKE, owner="M", positive=False, batch=False)
    with pytest.raises(ValueError, match="empty schedule"):
        check_noise([], LIKE, owner="M", positive=True, batch=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y, labels: DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2, 0.3]),
        lambda x, y, labels: DistributionCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2, 0.3]),
        lambda x, y, labels: DataCentricGPC(x, labels, rbf_kernel(), num_steps=3),
    ],
    ids=["DataCentricGPR", "DistributionCentricGPR", "DataCentricGPC"],
)
def test_assigning_noise_is_checked_alike_on_every_family_and_keeps_the_steps(make):
    x, y, labels = _data()
    model = make(x, y, labels)
    model.noise = 0.5  # one number: every step's
    assert model.num_steps == 3 and model.noise.tolist() == [0.5, 0.5, 0.5]
    model.noise = [0.4, 0.3, 0.2]
    assert model.noise.tolist() == [0.4, 0.3, 0.2] and model.noise.dtype == DT
    with pytest.raises(ValueError, match="num_steps=3 does not match the 2 steps.*fixed"):
        model.noise = torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match="finite numbers"):
        model.noise = -1.0
    assert model.noise.tolist() == [0.4, 0.3, 0.2]  # a refused value leaves the schedule


def test_an_assigned_regression_schedule_predicts_as_one_given_at_construction():
    x, y, _ = _data()
    test_x = torch.linspace(0, 4, 7, dtype=DT).unsqueeze(-1)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="dense")
    with torch.no_grad():
        model.predict(test_x)
        model.noise = torch.full((2, 2), 0.3, dtype=DT)  # a batch of schedules of the same T
        got = model.predict(test_x).mean
        fresh = DataCentricGPR(x, y, rbf_kernel(), noise=[0.3, 0.3], backend="dense")
        torch.testing.assert_close(got, fresh.predict(test_x).mean.expand(2, 2, 7))


def test_the_classifier_refuses_a_batch_of_schedules_by_the_documented_rule():
    x, _, labels = _data()
    with pytest.raises(ValueError, match=r"one schedule \(a batch of schedules \(\*s, T\) is for"):
        DataCentricGPC(x, labels, rbf_kernel(), num_steps=3, noise=torch.full((2, 3), 0.1))
