"""``set_train_data`` of the regression distillers: new data (another N included) replace the
old, checked as at construction, and the next prediction refactors."""

import gpytorch
import pytest
import torch

from gpsd import DataCentricGPR, DistributionCentricGPR

DT = torch.float64
GAMMA = [0.1, 0.2, 0.3]


def _kernel():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = 0.3
    return k


def _data(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=gen, dtype=DT)
    return x, torch.sin(6 * x) + 0.1 * torch.randn(n, generator=gen, dtype=DT)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg"])
def test_new_data_with_another_n_give_the_fresh_model(cls, backend):
    x, y = _data(20, 0)
    x2, y2 = _data(27, 1)
    test_x = torch.linspace(0, 1, 9, dtype=DT)
    kernel = _kernel()
    model = cls(x, y, kernel, noise=GAMMA, backend=backend)
    with torch.no_grad():
        model.predict(test_x)
        model.set_train_data(x2, y2, strict=False)
        got = model.predict(test_x)
        fresh = cls(x2, y2, kernel, noise=GAMMA, backend=backend).predict(test_x)
    assert model.train_x.shape == (27, 1)
    tol = 1e-10 if backend in ("dense", "cholesky") else 1e-6
    torch.testing.assert_close(got.mean, fresh.mean, rtol=tol, atol=tol)
    torch.testing.assert_close(got.variance, fresh.variance, rtol=tol, atol=tol)
    # step 1 of both is the GP with noise gamma_1 on the new data (dense formula)
    k = kernel(x2.unsqueeze(-1)).to_dense().detach()
    k_star = kernel(test_x.unsqueeze(-1), x2.unsqueeze(-1)).to_dense().detach()
    mean = k_star @ torch.linalg.solve(k + GAMMA[0] * torch.eye(27, dtype=DT), y2)
    torch.testing.assert_close(got.mean[0], mean, rtol=tol, atol=tol)


def test_targets_alone_and_checks():
    x, y = _data(20, 0)
    model = DataCentricGPR(x, y, _kernel(), noise=GAMMA, backend="dense")
    with torch.no_grad():
        model.set_train_data(targets=2 * y)
        twice = model.predict_mean(x)
        model.set_train_data(targets=y)
        once = model.predict_mean(x)
    torch.testing.assert_close(twice, 2 * once, rtol=1e-10, atol=1e-12)  # linear in the targets
    with pytest.raises(ValueError, match="targets must have the current shape, dtype"):
        model.set_train_data(targets=y.float())
    model.set_train_data(targets=y.float(), strict=False)  # converted to the model's dtype
    assert model.train_y.dtype == DT
    assert torch.equal(model.train_y, y.float().to(DT))
    with pytest.raises(ValueError, match="train_y must have 20 entries"):
        model.set_train_data(targets=y[:-1], strict=False)
    with pytest.raises(ValueError, match="train_y must be finite"):
        model.set_train_data(targets=y * torch.nan)
    with pytest.raises(ValueError, match="train_x must hold at least one input"):
        model.set_train_data(x[:0], y[:0], strict=False)
    batched = DataCentricGPR(x, y, _kernel(), noise=torch.tensor([GAMMA, GAMMA], dtype=DT))
    with pytest.raises(ValueError, match="must broadcast"):
        batched.set_train_data(targets=y.expand(3, 20), strict=False)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_a_state_dict_of_another_n_loads(cls):
    x, y = _data(20, 0)
    x2, y2 = _data(27, 1)
    test_x = torch.linspace(0, 1, 9, dtype=DT)
    kernel = _kernel()
    model = cls(x, y, kernel, noise=GAMMA, backend="dense")
    with torch.no_grad():
        model.predict(test_x)
        model.load_state_dict(cls(x2, y2, kernel, noise=GAMMA).state_dict())
        got = model.predict(test_x)
        fresh = cls(x2, y2, kernel, noise=GAMMA, backend="dense").predict(test_x)
    torch.testing.assert_close(got.mean, fresh.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.variance, fresh.variance, rtol=1e-10, atol=1e-10)
