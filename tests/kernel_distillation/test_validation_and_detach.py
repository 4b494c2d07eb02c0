"""Bad input is named where it enters; the student's buffers never carry an autograd graph."""

import copy
import warnings

import gpytorch
import pytest
import torch

from gpsd.kernel_distillation import (
    KernelDistillation,
    SparseLowRankStudent,
    kmeans,
    kmeans_plus_plus,
    nearest_inducing_points,
)

DT = torch.float64


def _data(n=60, d=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=DT)
    return x, torch.sin(2 * x).sum(-1)


def _kernel():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = 0.8
    k.outputscale = 1.5
    return k


@pytest.mark.parametrize("where", ["inducing_points", "x"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nearest_inducing_points_rejects_non_finite_inputs(where, bad):
    # One NaN inducing point made every distance NaN (through the centring), so every query got
    # the same arbitrary neighbours; a NaN query got arbitrary neighbours. Both passed silently.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, generator=gen, dtype=DT)
    u = torch.randn(5, 2, generator=gen, dtype=DT)
    if where == "x":
        x[3, 1] = bad
    else:
        u[2, 0] = bad
    with pytest.raises(ValueError, match=f"{where} must be finite"):
        nearest_inducing_points(x, u, 2)


def test_nearest_inducing_points_names_a_dtype_mismatch():
    x = torch.randn(10, 2, dtype=DT)
    with pytest.raises(ValueError, match="x and inducing_points must share a floating-point dtype"):
        nearest_inducing_points(x, x[:4].float(), 2)


@pytest.mark.parametrize("seed", [1.7, -1, "3", None])
def test_kmeans_seed_must_be_a_non_negative_int(seed):
    # seed=1.7 used to run as seed=1 and "3" as 3, silently
    x = torch.randn(20, 2, dtype=DT)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        kmeans_plus_plus(x, 3, seed=seed)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        kmeans(x, 3, seed=seed)


def test_kmeans_of_a_single_input_does_not_warn():
    # the stopping scale was an unbiased std: a UserWarning ("degrees of freedom <= 0") and NaN
    x = torch.tensor([[0.5, -1.0]], dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        centres = kmeans(x, 1)
    torch.testing.assert_close(centres, x)


def test_student_of_a_noise_that_requires_grad_holds_no_graph():
    # likelihood.noise is a function of raw_noise: its graph reached the student's buffers
    # (predictive_mean_weights, predictive_covariance_correction, noise), and deepcopy raised
    # "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol".
    x, y = _data()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    likelihood.noise = 0.05
    assert likelihood.noise.requires_grad
    kd = KernelDistillation.from_kernel(_kernel(), x, y, likelihood.noise, 10, 3, num_steps=2)
    student = kd.fit()
    assert not kd.noise.requires_grad
    assert not any(b.requires_grad for b in student.buffers())
    clone = copy.deepcopy(student)
    test_x = torch.randn(7, 2, dtype=DT)
    ref = KernelDistillation.from_kernel(_kernel(), x, y, 0.05, 10, 3, num_steps=2).fit()
    for got, want in zip(clone.predict(test_x), ref.predict(test_x), strict=True):
        torch.testing.assert_close(got, want)
    # from_sparse_weights and the constructor detach, too
    direct = SparseLowRankStudent.from_sparse_weights(
        kd.kernel, kd.inducing_points, kd.weight_values, kd.neighbour_indices,
        y.clone().requires_grad_(), likelihood.noise,
    )  # fmt: skip
    assert not any(b.requires_grad for b in direct.buffers())
    copy.deepcopy(direct)


@pytest.mark.parametrize("shape", [(2, 60), (1, 60)])
def test_from_kernel_needs_a_one_dimensional_train_y(shape):
    # (2, n) targets passed every check, ran the whole distillation and then failed inside the
    # student with "index_add_(): Number of indices (180) should be equal to source.size(dim)"
    x, y = _data()
    with pytest.raises(ValueError, match=r"train_y must have shape \(n=60,\)"):
        KernelDistillation.from_kernel(_kernel(), x, y.expand(*shape), 0.05, 10, 3)


def test_from_kernel_rejects_a_non_finite_mean_constant():
    x, y = _data()
    with pytest.raises(ValueError, match="mean_constant must be finite"):
        KernelDistillation.from_kernel(_kernel(), x, y, 0.05, 10, 3, mean_constant=float("nan"))


def test_from_sparse_weights_checks_the_indices():
    x, y = _data(n=20)
    u = x[:5].clone()
    values = torch.rand(20, 2, generator=torch.Generator().manual_seed(1), dtype=DT)
    idx = torch.randint(5, (20, 2), generator=torch.Generator().manual_seed(2))
    SparseLowRankStudent.from_sparse_weights(_kernel(), u, values, idx, y, 0.1)  # valid
    # float indices were truncated silently
    with pytest.raises(TypeError, match="weight_indices must hold integer indices"):
        SparseLowRankStudent.from_sparse_weights(_kernel(), u, values, idx + 0.7, y, 0.1)
    for bad in (-1, 5):
        wrong = idx.clone()
        wrong[3, 1] = bad
        with pytest.raises(ValueError, match=r"weight_indices must lie in \[0, m=5\)"):
            SparseLowRankStudent.from_sparse_weights(_kernel(), u, values, wrong, y, 0.1)
    with pytest.raises(ValueError, match=r"train_y must have shape \(n=20,\)"):
        SparseLowRankStudent.from_sparse_weights(_kernel(), u, values, idx, y.expand(1, 20), 0.1)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(inducing_covariance=torch.full((5, 5), float("nan"), dtype=DT)), "inducing_cov"),
        (
            dict(predictive_covariance_correction=torch.full((5, 5), float("inf"), dtype=DT)),
            "predictive_covariance_correction must be finite",
        ),
        (dict(noise=float("inf")), "noise must be one positive variance"),
        (dict(mean_constant=float("nan")), "mean_constant must be one finite number"),
        (dict(neighbour_scale=torch.tensor([1.0, float("inf")], dtype=DT)), "neighbour_scale"),
    ],
)
def test_student_constructor_rejects_non_finite_values(changes, match):
    # each of these was accepted and predicted NaN (or, for the scale, arbitrary neighbours)
    args = dict(
        kernel=_kernel(),
        inducing_points=torch.randn(5, 2, generator=torch.Generator().manual_seed(0), dtype=DT),
        inducing_covariance=torch.eye(5, dtype=DT),
        predictive_mean_weights=torch.zeros(5, dtype=DT),
        predictive_covariance_correction=torch.eye(5, dtype=DT),
        sparsity=2,
        noise=0.1,
    )
    SparseLowRankStudent(**args)
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        SparseLowRankStudent(**args)


@pytest.mark.parametrize("kwargs", [{}, {"step_size": 1e-3}])
def test_callback_reports_the_error_after_each_step(kwargs, capsys):
    # callback(step, error) received the error *before* the step (callback(0, .) the initial
    # error), so the error of the final W never reached it.
    x, y = _data()
    seen = []
    kd = KernelDistillation.from_kernel(
        _kernel(), x, y, 0.05, 10, 3, num_steps=3, progress=True,
        callback=lambda step, err: seen.append((step, err)), **kwargs,
    )  # fmt: skip
    kd.fit()
    assert [s for s, _ in seen] == [0, 1, 2]
    assert [e for _, e in seen] == kd.frobenius_errors[1:]
    # independently: the error of the final W from a dense residual
    k = _kernel()
    w = kd.dense_weights()
    with torch.no_grad():
        dense = torch.linalg.matrix_norm(
            k(x).to_dense() - w @ k(kd.inducing_points).to_dense() @ w.T
        )
    assert seen[-1][1] == pytest.approx(float(dense), rel=1e-10)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and lines[-1].endswith(f"{seen[-1][1]:.4e}")
