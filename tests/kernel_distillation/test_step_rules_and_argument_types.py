"""A fixed step that raises the distillation error is reported (it used to return a worse
student silently, or fail building the student with advice about float64), and array-like or
wrongly typed arguments get errors that name them."""

import warnings

import gpytorch
import numpy as np
import pytest
import torch

from gpsd.kernel_distillation import (
    KernelDistillation,
    SparseLowRankStudent,
    nearest_inducing_points,
)

DT = torch.float64
X = torch.linspace(0, 1, 40, dtype=DT).unsqueeze(-1)
Y = torch.sin(6 * X).squeeze(-1)


def _kernel():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)


def _distiller(num_steps=5, **kwargs):
    return KernelDistillation.from_kernel(
        _kernel(), X, Y, 0.01, 10, 3, num_steps=num_steps, **kwargs
    )


def test_a_fixed_step_that_raises_the_error_warns_and_names_it():
    kd = _distiller(step_size=0.1)
    with pytest.warns(RuntimeWarning, match=r"larger error .* step_size=0.1 is too large"):
        kd.fit()
    errors = kd.frobenius_errors
    # the warning reports what the recorded errors show: the step made the fit worse
    assert errors[-1] > 10 * errors[0]
    dense_w = kd.dense_weights()
    k_xx = kd.kernel(X, X).to_dense().detach()
    direct = torch.linalg.matrix_norm(k_xx - dense_w @ kd.inducing_covariance @ dense_w.T)
    torch.testing.assert_close(torch.tensor(errors[-1], dtype=DT), direct, rtol=1e-8, atol=0)


def test_a_diverging_fixed_step_names_the_step_size_not_the_precision():
    # the error grows about 1e5-fold a step from 4e-4: beyond float64's range within 10 steps,
    # whatever the rounding of the start
    # (overflow on the way may also warn, depending on where it happens)
    kd = _distiller(num_steps=10, step_size=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(RuntimeError, match="step_size=1 is too large"):
            kd.fit()


@pytest.mark.parametrize("kwargs", [{}, {"step_size": 1e-4}])
def test_steps_that_lower_the_error_do_not_warn(kwargs):
    kd = _distiller(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        kd.fit()
    assert kd.frobenius_errors[-1] <= kd.frobenius_errors[0]


@pytest.mark.parametrize("name, value", [("step_size", "0.1"), ("jitter", "1e-6")])
def test_string_settings_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"{name} must be"):
        _distiller(**{name: value})


def test_from_sparse_weights_takes_array_indices_and_refuses_a_kernel_name():
    kd = _distiller()
    student = kd.fit()
    test_x = torch.linspace(0, 1, 15, dtype=DT).unsqueeze(-1)
    args = (kd.inducing_points, kd.weight_values)
    rebuilt = SparseLowRankStudent.from_sparse_weights(
        _kernel(), *args, kd.neighbour_indices.numpy(), Y, 0.01
    )
    for got, expected in zip(rebuilt.predict(test_x), student.predict(test_x), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="kernel must be a gpytorch.kernels.Kernel"):
        SparseLowRankStudent.from_sparse_weights("rbf", *args, kd.neighbour_indices, Y, 0.01)
    with pytest.raises(TypeError, match="weight_indices must hold integer indices"):
        SparseLowRankStudent.from_sparse_weights(_kernel(), *args, kd.weight_values, Y, 0.01)


def test_nearest_inducing_points_takes_arrays():
    gen = np.random.default_rng(0)
    x, u = gen.normal(size=(30, 2)), gen.normal(size=(6, 2))
    distances, indices = nearest_inducing_points(x, u, 2)
    # an independent brute-force search
    brute = ((x[:, None, :] - u[None, :, :]) ** 2).sum(-1)
    expected = np.argsort(brute, axis=1)[:, :2]
    np.testing.assert_array_equal(indices.numpy(), expected)
    np.testing.assert_allclose(
        distances.numpy(), np.take_along_axis(brute, expected, 1), rtol=1e-12
    )


def test_near_coincident_inducing_points_are_named_not_the_precision():
    # float64 and a noise of 1e-2: the old message blamed the noise and advised float64
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(60, 1, generator=gen, dtype=DT)
    u = torch.cat([x[:10], x[:10] + 1e-9])
    kd = KernelDistillation.from_kernel(
        _kernel(), x, torch.sin(x.squeeze(-1)), 1e-2, 20, 10, num_steps=10, inducing_points=u
    )
    with pytest.raises(RuntimeError, match="near-coincident or duplicated inducing points") as err:
        kd.fit()
    assert "float64" not in str(err.value)
