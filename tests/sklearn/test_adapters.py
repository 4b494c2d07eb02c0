"""The scikit-learn adapters against the native classes and independent computations."""

import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")

import gpytorch  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from sklearn.base import clone  # noqa: E402
from sklearn.gaussian_process import GaussianProcessRegressor  # noqa: E402
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel  # noqa: E402
from sklearn.model_selection import GridSearchCV  # noqa: E402

import gpsd  # noqa: E402
import gpsd.sklearn  # noqa: E402
from gpsd import DataCentricGPC, DataCentricGPR, DistributionCentricGPR, KernelDistillation  # noqa: E402
from gpsd.laplace import MulticlassLaplacePosterior  # noqa: E402
from gpsd.sklearn import (  # noqa: E402
    DeepProbabilisticKernelRegressor,
    KernelDistilledRegressor,
    SelfDistilledGPClassifier,
    SelfDistilledGPRegressor,
)


def regression_data(n=40, m=15, d=2, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.uniform(-2, 2, size=(n + m, d))
    y = np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] ** 2 + 0.1 * rng.randn(n + m)
    return x[:n], y[:n], x[n:]


def classification_data(n=40, m=15, seed=1):
    rng = np.random.RandomState(seed)
    x = rng.randn(n + m, 2)
    y = (x[:, 0] + 0.5 * x[:, 1] + 0.3 * rng.randn(n + m) > 0).astype(int)
    return x[:n], y[:n], x[n:]


def kernel(lengthscale, outputscale):
    covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    covar_module.base_kernel.lengthscale = lengthscale
    covar_module.outputscale = outputscale
    return covar_module


FIXED = dict(lengthscale=0.7, outputscale=1.3, optimize_hyperparameters=False, normalize_y=False)


@pytest.mark.parametrize("method", ["data_centric", "distribution_centric"])
def test_regressor_predicts_as_the_native_distiller(method):
    x, y, test_x = regression_data()
    schedule = [0.2, 0.1, 0.05]
    estimator = SelfDistilledGPRegressor(
        noise=schedule, num_steps=3, step=2, method=method, **FIXED
    ).fit(x, y)
    native_class = DataCentricGPR if method == "data_centric" else DistributionCentricGPR
    native = native_class(
        torch.from_numpy(x), torch.from_numpy(y), kernel(0.7, 1.3), noise=schedule
    )
    with torch.no_grad():
        expected = native.predict(torch.from_numpy(test_x), step=2)
    mean, std = estimator.predict(test_x, return_std=True)
    np.testing.assert_allclose(mean, expected.mean.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(std, expected.stddev.numpy(), rtol=1e-10, atol=1e-12)
    assert estimator.step_ == 2
    np.testing.assert_array_equal(estimator.noise_, schedule)


def test_regressor_step_one_is_scikit_learns_gp_regression():
    """Step 1 is GP regression with noise gamma: scikit-learn's GaussianProcessRegressor with
    the same kernel and alpha = gamma, an independent implementation. GPyTorch's squared
    distances (expanded as |x|^2 + |x'|^2 - 2 x.x') agree with scipy's to about 1e-8."""
    x, y, test_x = regression_data()
    estimator = SelfDistilledGPRegressor(noise=0.1, num_steps=4, step=1, **FIXED).fit(x, y)
    reference = GaussianProcessRegressor(
        ConstantKernel(1.3, "fixed") * RBF(0.7, "fixed"), alpha=0.1, optimizer=None
    ).fit(x, y)
    expected_mean, expected_std = reference.predict(test_x, return_std=True)
    mean, std = estimator.predict(test_x, return_std=True)
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(std, expected_std, rtol=1e-6, atol=1e-8)


def test_regressor_gcv_step_is_the_native_best_step():
    x, y, _ = regression_data(n=60)
    estimator = SelfDistilledGPRegressor(noise=0.02, num_steps=8, **FIXED).fit(x, y)
    native = DataCentricGPR(
        torch.from_numpy(x), torch.from_numpy(y), kernel(0.7, 1.3), noise=0.02, num_steps=8
    )
    assert estimator.step_ == native.best_step("gcv")
    assert estimator.step_ == int(np.argmin(estimator.gcv_)) + 1
    np.testing.assert_allclose(estimator.gcv_, native.gcv().detach().numpy(), rtol=1e-10)
    np.testing.assert_array_equal(estimator.gcv_standard_error_, np.zeros(8))  # exact trace


@pytest.mark.filterwarnings("ignore::gpytorch.utils.warnings.NumericalWarning")
def test_regressor_scores_steps_when_auto_falls_back_to_cg():
    """Issue 42's snippet: backend="auto" choosing CG fits, with estimated GCV scores."""
    X = np.random.default_rng(0).uniform(0, 10, (300, 3))
    y = np.sin(X).sum(1)
    with gpsd.settings.dense_max_n(cpu=50), gpsd.settings.max_lanczos_rank(8):
        estimator = gpsd.sklearn.SelfDistilledGPRegressor(backend="auto").fit(X, y)
        assert isinstance(estimator.model_._current_fit().engine, gpsd.linalg.ShiftedCG)
    assert estimator.gcv_.shape == estimator.gcv_standard_error_.shape == (5,)
    assert np.isfinite(estimator.gcv_).all() and (estimator.gcv_standard_error_ > 0).all()
    assert estimator.step_ == int(np.argmin(estimator.gcv_)) + 1
    assert np.isfinite(estimator.predict(X[:4])).all()


def test_regressor_learns_hyperparameters_and_scales_back():
    """With standardised targets and learnt hyperparameters, a shifted and scaled copy of y
    gives the shifted and scaled predictions."""
    x, y, test_x = regression_data(n=50)
    first = SelfDistilledGPRegressor(max_iter=30).fit(x, y)
    second = SelfDistilledGPRegressor(max_iter=30).fit(x, 3.0 * y + 5.0)
    np.testing.assert_allclose(second.predict(test_x), 3.0 * first.predict(test_x) + 5.0, rtol=1e-6)
    assert first.model_.covar_module.base_kernel.lengthscale.item() != pytest.approx(1.0)
    assert first.n_iter_ == 30
    assert first.score(x, y) > 0.9


def test_teacher_hyperparameters_maximise_the_marginal_likelihood():
    """The learnt lengthscale, outputscale and noise reach the log marginal likelihood of
    scikit-learn's own optimum (L-BFGS-B on ConstantKernel * RBF + WhiteKernel)."""
    x, y, _ = regression_data(n=50)
    y = y - y.mean()
    estimator = SelfDistilledGPRegressor(
        normalize_y=False, max_iter=300, lr=0.05, num_steps=1, step=1
    ).fit(x, y)
    covar_module = estimator.model_.covar_module
    theta = np.log(
        [
            covar_module.outputscale.item(),
            covar_module.base_kernel.lengthscale.item(),
            estimator.noise_[0],
        ]
    )
    reference = GaussianProcessRegressor(
        ConstantKernel() * RBF() + WhiteKernel(), n_restarts_optimizer=2, random_state=0
    ).fit(x, y)
    assert reference.log_marginal_likelihood(theta) == pytest.approx(
        reference.log_marginal_likelihood_value_, abs=1e-3
    )


def test_ard_regressor_fits_one_lengthscale_per_feature_and_predicts_with_them():
    """With ``ard=True`` the teacher's Adam steps are those of a GPyTorch ExactGP with an ARD RBF
    kernel trained on GPyTorch's own marginal likelihood, and step 1 predicts as scikit-learn's
    GP with the lengthscales learnt."""
    x, y, test_x = regression_data(n=50)
    estimator = SelfDistilledGPRegressor(ard=True, max_iter=30, num_steps=2, step=1).fit(x, y)
    covar_module = estimator.model_.covar_module
    lengthscales = covar_module.base_kernel.lengthscale.detach().numpy().reshape(-1)
    outputscale, noise = covar_module.outputscale.item(), estimator.noise_[0]
    assert lengthscales.shape == (2,) and abs(lengthscales[0] - lengthscales[1]) > 0.1

    class ExactGP(gpytorch.models.ExactGP):
        def __init__(self, tx, ty, likelihood):
            super().__init__(tx, ty, likelihood)
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(ard_num_dims=2)
            )

        def forward(self, tx):
            return gpytorch.distributions.MultivariateNormal(
                torch.zeros_like(tx[:, 0]), self.covar_module(tx)
            )

    tx, ty = torch.from_numpy(x), torch.from_numpy((y - y.mean()) / y.std())
    likelihood = gpytorch.likelihoods.GaussianLikelihood(
        noise_constraint=gpytorch.constraints.GreaterThan(1e-6)
    ).double()
    likelihood.noise = 0.1
    model = ExactGP(tx, ty, likelihood).double()
    model.covar_module.base_kernel.lengthscale = 1.0  # the estimator's defaults
    model.covar_module.outputscale = 1.0
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model.train()
    for _ in range(30):
        optimizer.zero_grad()
        (-mll(model(tx), ty)).backward()
        optimizer.step()
    np.testing.assert_allclose(
        lengthscales, model.covar_module.base_kernel.lengthscale.detach().numpy().reshape(-1),
        rtol=1e-6,
    )  # fmt: skip
    assert noise == pytest.approx(likelihood.noise.item(), rel=1e-6)
    fixed = GaussianProcessRegressor(
        ConstantKernel(outputscale, "fixed") * RBF(lengthscales, "fixed"),
        alpha=noise,
        optimizer=None,
        normalize_y=False,
    ).fit(x, (y - y.mean()) / y.std())
    np.testing.assert_allclose(
        (estimator.predict(test_x) - y.mean()) / y.std(),
        fixed.predict(test_x),
        rtol=1e-6,
        atol=1e-8,
    )


def test_regressor_device_is_where_it_fits_and_a_bad_device_is_named():
    x, y, test_x = regression_data()
    estimator = SelfDistilledGPRegressor(device="cpu", noise=0.1, **FIXED).fit(x, y)
    assert estimator.model_.train_x.device.type == "cpu"
    assert isinstance(estimator.predict(test_x), np.ndarray)
    with pytest.raises(ValueError, match="device"):
        SelfDistilledGPRegressor(device="gpu").fit(x, y)
    with pytest.raises(ValueError, match="ard"):
        SelfDistilledGPRegressor(ard="yes").fit(x, y)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device is 'cuda'"):
            SelfDistilledGPRegressor(device="cuda").fit(x, y)


@requires_cuda
def test_regressor_on_cuda_predicts_as_on_the_cpu():
    x, y, test_x = regression_data()
    on_cpu = SelfDistilledGPRegressor(ard=True, max_iter=20).fit(x, y)
    on_gpu = SelfDistilledGPRegressor(ard=True, max_iter=20, device="cuda").fit(x, y)
    assert on_gpu.model_.train_x.device.type == "cuda"
    mean, std = on_gpu.predict(test_x, return_std=True)
    expected_mean, expected_std = on_cpu.predict(test_x, return_std=True)
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(std, expected_std, rtol=1e-6, atol=1e-8)


def test_regressor_refuses_a_schedule_of_the_wrong_length():
    x, y, _ = regression_data()
    with pytest.raises(ValueError, match="num_steps"):
        SelfDistilledGPRegressor(noise=[0.1, 0.2], num_steps=3).fit(x, y)
    with pytest.raises(ValueError, match="step"):
        SelfDistilledGPRegressor(step=9, num_steps=3).fit(x, y)


@pytest.mark.parametrize(
    "make",
    [
        SelfDistilledGPRegressor,
        KernelDistilledRegressor,
        lambda: DeepProbabilisticKernelRegressor(max_iter=1),
    ],
    ids=["self-distilled", "kernel-distilled", "dpkl"],
)
@pytest.mark.parametrize(
    "targets",
    [
        np.array(["low", "high"] * 10),
        np.array(["1.5", "2"] * 10),  # numbers written as strings are not converted either
        np.array(["low", 2.0] * 10, dtype=object),
        ["low", "high"] * 10,
    ],
    ids=["str", "numeric-str", "object", "list"],
)
def test_regressors_refuse_string_targets_naming_y(make, targets):
    x, _, _ = regression_data(n=20)
    with pytest.raises(ValueError, match="y must hold numbers.*starting '(low|1.5)'"):
        make().fit(x, targets)


def test_regressors_take_numbers_held_as_objects_or_bools():
    x, y, test_x = regression_data(n=20)
    reference = SelfDistilledGPRegressor(**FIXED).fit(x, y).predict(test_x)
    as_objects = SelfDistilledGPRegressor(**FIXED).fit(x, y.astype(object)).predict(test_x)
    np.testing.assert_array_equal(as_objects, reference)
    SelfDistilledGPRegressor(**FIXED).fit(x, y > 0)


def test_classifier_maps_any_two_labels():
    x, y, test_x = classification_data()
    names = np.array(["no", "yes"])[y]
    numeric = SelfDistilledGPClassifier(optimize_hyperparameters=False).fit(x, y)
    named = SelfDistilledGPClassifier(optimize_hyperparameters=False).fit(x, names)
    np.testing.assert_array_equal(named.classes_, ["no", "yes"])
    np.testing.assert_allclose(named.predict_proba(test_x), numeric.predict_proba(test_x))
    np.testing.assert_array_equal(named.predict(test_x), names_of(numeric.predict(test_x)))
    signs = SelfDistilledGPClassifier(optimize_hyperparameters=False).fit(x, 2 * y - 1)
    np.testing.assert_array_equal(signs.classes_, [-1, 1])
    np.testing.assert_allclose(signs.predict_proba(test_x), numeric.predict_proba(test_x))


def names_of(labels):
    return np.array(["no", "yes"])[labels]


def test_classifier_takes_one_noise_schedule():
    x, y, _ = classification_data()
    estimator = SelfDistilledGPClassifier(
        num_steps=2, noise=[[0.0, 0.1], [0.1, 0.1]], optimize_hyperparameters=False
    )
    with pytest.raises(ValueError, match=r"noise must be one number or a sequence of num_steps"):
        estimator.fit(x, y)


def test_classifier_predicts_as_the_native_distiller():
    x, y, test_x = classification_data()
    estimator = SelfDistilledGPClassifier(
        num_steps=3, step=2, noise=[0.0, 0.1, 0.1], lengthscale=0.8, optimize_hyperparameters=False
    ).fit(x, y)
    native = DataCentricGPC(
        torch.from_numpy(x),
        torch.from_numpy(y).double(),
        kernel(0.8, 1.0),
        num_steps=3,
        noise=torch.tensor([0.0, 0.1, 0.1], dtype=torch.float64),
    )
    with torch.no_grad():
        expected = native.predict_proba(torch.from_numpy(test_x), step=2).numpy()
    proba = estimator.predict_proba(test_x)
    assert proba.shape == (len(test_x), 2)
    np.testing.assert_allclose(proba, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(estimator.predict(test_x), expected.argmax(axis=1))


def iris_subset(n=36, m=12, seed=0):
    """Standardised iris inputs of n training and m test rows, the classes named so that their
    sorted order differs from iris's target order."""
    from sklearn.datasets import load_iris

    data = load_iris()
    rows = np.random.RandomState(seed).permutation(len(data.target))[: n + m]
    x = data.data[rows]
    x = (x - x[:n].mean(0)) / x[:n].std(0)
    names = np.array(["virginica", "setosa", "versicolor"])[data.target[rows]]
    return x[:n], names[:n], x[n:]


def test_classifier_predicts_three_classes_as_the_native_distiller():
    x, names, test_x = iris_subset()
    estimator = SelfDistilledGPClassifier(
        num_steps=2,
        noise=[0.0, 0.1],
        lengthscale=1.5,
        num_samples=512,
        optimize_hyperparameters=False,
    ).fit(x, names)
    np.testing.assert_array_equal(estimator.classes_, ["setosa", "versicolor", "virginica"])
    labels = np.searchsorted(estimator.classes_, names)
    native = DataCentricGPC(
        torch.from_numpy(x),
        torch.from_numpy(labels),
        kernel(1.5, 1.0),
        num_steps=2,
        noise=torch.tensor([0.0, 0.1], dtype=torch.float64),
        num_samples=512,
    )
    with torch.no_grad():
        expected = native.predict_proba(torch.from_numpy(test_x), step=2).numpy()
    proba = estimator.predict_proba(test_x)
    assert proba.shape == (len(test_x), 3)
    np.testing.assert_allclose(proba, expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(
        estimator.predict(test_x), estimator.classes_[expected.argmax(axis=1)]
    )
    assert estimator.score(x, names) > 0.8


def test_classifier_fits_the_kernel_of_three_classes_by_the_softmax_evidence():
    x, names, _ = iris_subset(n=30, m=0)
    estimator = SelfDistilledGPClassifier(max_iter=15, lr=0.1).fit(x, names)
    labels = torch.from_numpy(np.searchsorted(estimator.classes_, names)).double()
    train_x = torch.from_numpy(x)

    def evidence(covar_module):
        with torch.no_grad():
            covariance = covar_module(train_x).to_dense()
        return float(
            MulticlassLaplacePosterior(
                0.0, covariance, "softmax", labels, num_classes=3
            ).log_marginal_likelihood()
        )

    fitted = estimator.model_.covar_module
    assert fitted.base_kernel.lengthscale.item() != pytest.approx(1.0)
    assert evidence(fitted) > evidence(kernel(1.0, 1.0)) + 1.0

    # the same Adam iterations written out, every Newton run from the prior mean
    reference = kernel(1.0, 1.0)
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.1)
    for _ in range(15):
        optimizer.zero_grad()
        posterior = MulticlassLaplacePosterior(
            0.0, reference(train_x).to_dense(), "softmax", labels, num_classes=3
        )
        (-posterior.log_marginal_likelihood() / len(labels)).backward()
        optimizer.step()
    for name in ("base_kernel.raw_lengthscale", "raw_outputscale"):
        torch.testing.assert_close(
            fitted.get_parameter(name), reference.get_parameter(name), rtol=0, atol=1e-8
        )


def test_classifier_refuses_continuous_targets():
    x, y, _ = classification_data()
    with pytest.raises(ValueError, match="Unknown label type"):
        SelfDistilledGPClassifier().fit(x, y + 0.25)


def test_kernel_distilled_regressor_predicts_as_its_student():
    x, y, test_x = regression_data(n=60)
    estimator = KernelDistilledRegressor(num_inducing=12, sparsity=4, random_state=3, **FIXED).fit(
        x, y
    )
    seed = int(np.random.RandomState(3).randint(np.iinfo(np.int32).max))
    distiller = KernelDistillation.from_data(
        torch.from_numpy(x),
        torch.from_numpy(y),
        kernel(0.7, 1.3),
        noise=0.1,
        num_inducing=12,
        sparsity=4,
        seed=seed,
    ).fit()
    expected = distiller.student.predict(torch.from_numpy(test_x))
    mean, std = estimator.predict(test_x, return_std=True)
    np.testing.assert_allclose(mean, expected.mean.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(std, expected.stddev.numpy(), rtol=1e-10, atol=1e-12)


def test_dpkl_is_deterministic_given_random_state_and_leaves_torch_seeded():
    x, y, test_x = regression_data(n=40)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = DeepProbabilisticKernelRegressor(max_iter=10, random_state=7).fit(x, y)
    assert torch.equal(torch.get_rng_state(), state)
    second = clone(first).fit(x, y)
    np.testing.assert_array_equal(first.predict(test_x), second.predict(test_x))
    other = DeepProbabilisticKernelRegressor(max_iter=10, random_state=8).fit(x, y)
    assert not np.allclose(first.predict(test_x), other.predict(test_x))
    assert first.model_.num_particles == 4


def test_grid_search_over_steps():
    x, y, _ = regression_data(n=45)
    search = GridSearchCV(
        SelfDistilledGPRegressor(max_iter=10, noise=0.05), {"num_steps": [1, 3]}, cv=3
    ).fit(x, y)
    assert search.best_params_["num_steps"] in (1, 3)
    assert np.all(np.isfinite(search.cv_results_["mean_test_score"]))


def test_import_gpsd_does_not_import_sklearn():
    code = "import sys, gpsd; assert 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpsd_sklearn_without_sklearn_names_the_extra():
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "try:\n    import gpsd.sklearn\nexcept ImportError as err:\n    print(err)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    )
    assert "gpsd[sklearn]" in result.stdout
