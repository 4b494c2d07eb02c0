"""Bad learning rates and initial lengthscales of the DPKL regressors name the argument."""

import pytest
import torch
from torch import nn

from gpsd.dpkl import ARDGPRegressor, DPKLRegressor


def _data(n=12):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


@pytest.mark.parametrize("lr", ["0.01", True, torch.tensor([0.1, 0.2])])
def test_regressor_fit_names_a_bad_lr(lr):
    # "0.01" gave TypeError('must be real number, not str'), naming nothing; True was taken as
    # a learning rate of 1.0 and trained; a 2-element tensor gave ValueError('only one element
    # tensors can be converted to Python scalars')
    x, y = _data()
    model = DPKLRegressor(x, y, lambda: nn.Linear(3, 2), num_particles=2, num_random_features=3)
    with pytest.raises(ValueError, match="lr"):
        model.fit(1, lr=lr)


@pytest.mark.parametrize("value", ["1.0", True, torch.tensor([1.0, 2.0, 3.0])])
def test_ard_gp_names_a_bad_initial_lengthscale(value):
    # "1.0" gave TypeError('must be real number, not str'); a tensor of three lengthscales
    # gave ValueError('only one element tensors can be converted to Python scalars'); True
    # was taken as a lengthscale of 1.0
    x, y = _data()
    with pytest.raises(ValueError, match="initial_lengthscale"):
        ARDGPRegressor(x, y, initial_lengthscale=value)


def test_numpy_and_tensor_scalars_are_still_accepted():
    np = pytest.importorskip("numpy")
    x, y = _data()
    ARDGPRegressor(x, y, initial_lengthscale=np.float32(1.5)).fit(1, lr=np.float64(0.01))
    ARDGPRegressor(x, y, initial_lengthscale=torch.tensor(1.5)).fit(1, lr=torch.tensor(0.01))
