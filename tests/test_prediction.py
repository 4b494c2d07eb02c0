import gpytorch
import pytest
import torch

from gpsd import Prediction


def test_stddev_is_the_square_root_of_the_variance_with_rounding_negatives_at_zero():
    variance = torch.tensor([4.0, 0.25, -1e-18], dtype=torch.float64)
    prediction = Prediction(torch.zeros(3, dtype=torch.float64), variance)
    assert torch.equal(prediction.stddev, torch.tensor([2.0, 0.5, 0.0], dtype=torch.float64))


def test_to_distribution_is_diagonal_without_covariance_and_full_with_it():
    mean = torch.tensor([1.0, 2.0])
    variance = torch.tensor([0.5, 2.0])
    dist = Prediction(mean, variance).to_distribution()
    assert isinstance(dist, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(dist.covariance_matrix, torch.diag(variance))
    cov = torch.tensor([[0.5, 0.1], [0.1, 2.0]])
    full = Prediction(mean, variance, cov).to_distribution()
    torch.testing.assert_close(full.covariance_matrix, cov)


def test_select_takes_one_index_of_a_dimension_and_the_matching_covariances():
    mean = torch.arange(24.0).reshape(2, 3, 4)  # (batch, T, M)
    cov = torch.arange(96.0).reshape(2, 3, 4, 4)
    prediction = Prediction(mean, mean + 100, cov)
    step = prediction.select(1, dim=-2)
    assert torch.equal(step.mean, mean[:, 1])
    assert torch.equal(step.variance, mean[:, 1] + 100)
    assert torch.equal(step.covariance, cov[:, 1])
    assert torch.equal(prediction.select(0, dim=0).mean, mean[0])


def test_a_prediction_is_immutable_and_its_repr_gives_shapes():
    prediction = Prediction(torch.zeros(2, 5), torch.ones(2, 5))
    with pytest.raises(AttributeError):
        prediction.mean = torch.ones(2, 5)
    assert "mean=(2, 5)" in repr(prediction) and "covariance" not in repr(prediction)
