"""The convention of docs/convention.rst, checked on every public estimator.

The test walks ``gpsd.__all__`` and the subpackages' ``__all__``: every public class with a
``fit`` or ``predict`` method must have a factory below (a new estimator cannot skip these
checks), and each is held to the rules its kind follows.
"""

from __future__ import annotations

import inspect

import gpytorch
import pytest
import torch
from torch import nn

import gpsd
from gpsd import (
    ARDGPRegressor,
    CombinedGPC,
    CombinedGPR,
    DataCentricGPC,
    DataCentricGPR,
    DistributionCentricGPC,
    DistributionCentricGPR,
    DKLRegressor,
    DPKLClassifier,
    DPKLRegressor,
    KernelDistillation,
    LaplaceGPClassifier,
    NotFittedError,
    Prediction,
    SparseLowRankStudent,
    SSDPKLRegressor,
)
from gpsd.kernel_distillation import kmeans
from gpsd.linalg import EngineRequest, KernelSpectrum, make_engine

DT = torch.float64
N, M, T = 24, 7, 3

SUBPACKAGES = [
    gpsd.data,
    gpsd.distillation,
    gpsd.dpkl,
    gpsd.kernel_distillation,
    gpsd.kernels,
    gpsd.laplace,
    gpsd.likelihoods,
    gpsd.linalg,
    gpsd.means,
]

# ---------------------------------------------------------------------------- data and factories


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(N, 2, generator=gen, dtype=DT) * 4
    y = torch.sin(x).sum(-1) + 0.1 * torch.randn(N, generator=gen, dtype=DT)
    test_x = torch.rand(M, 2, generator=gen, dtype=DT) * 4
    labels = (y > y.median()).to(DT)
    return x, y, labels, test_x


def _kernel():
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    kernel.base_kernel.lengthscale = 1.0
    return kernel


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2)).to(DT)


def _teacher(x, y):
    class Teacher(gpytorch.models.ExactGP):
        def __init__(self):
            likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
            super().__init__(x, y, likelihood)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = _kernel()

        def forward(self, inputs):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(inputs), self.covar_module(inputs)
            )

    teacher = Teacher()
    teacher.likelihood.noise = 0.05
    return teacher.eval()


# kind: "distiller-regressor", "regressor", "classifier", "distiller-classifier", "distiller"
FACTORIES = {
    CombinedGPR: (
        "distiller-regressor",
        lambda x, y, lab: CombinedGPR(x, y, _kernel(), noise=[[0.1, 0.2, 0.3]]),
    ),
    DataCentricGPR: (
        "distiller-regressor",
        lambda x, y, lab: DataCentricGPR(x, y, _kernel(), noise=[0.1, 0.2, 0.3]),
    ),
    DistributionCentricGPR: (
        "distiller-regressor",
        lambda x, y, lab: DistributionCentricGPR(x, y, _kernel(), noise=[0.1, 0.2, 0.3]),
    ),
    LaplaceGPClassifier: ("classifier", lambda x, y, lab: LaplaceGPClassifier(x, lab, _kernel())),
    CombinedGPC: (
        "distiller-classifier",
        lambda x, y, lab: CombinedGPC(x, lab, _kernel(), noise=[[0.0, 0.1, 0.0]]),
    ),
    DataCentricGPC: (
        "distiller-classifier",
        lambda x, y, lab: DataCentricGPC(x, lab, _kernel(), num_steps=T),
    ),
    DistributionCentricGPC: (
        "distiller-classifier",
        lambda x, y, lab: DistributionCentricGPC(x, lab, _kernel(), num_steps=T),
    ),
    KernelDistillation: (
        "distiller",
        lambda x, y, lab: KernelDistillation(
            _teacher(x, y), num_inducing=8, sparsity=4, max_iter=3, require_trained=False
        ),
    ),
    SparseLowRankStudent: (
        "regressor",
        lambda x, y, lab: (
            KernelDistillation(
                _teacher(x, y), num_inducing=8, sparsity=4, max_iter=2, require_trained=False
            )
            .fit()
            .student
        ),
    ),
    DPKLRegressor: (
        "regressor",
        lambda x, y, lab: DPKLRegressor(x, y, _net(), num_particles=2, num_random_features=8),
    ),
    SSDPKLRegressor: (
        "regressor",
        lambda x, y, lab: SSDPKLRegressor(
            x, y, _net(), unlabelled_x=x + 0.5, num_particles=2, num_random_features=8
        ),
    ),
    DKLRegressor: ("regressor", lambda x, y, lab: DKLRegressor(x, y, _net())),
    ARDGPRegressor: ("regressor", lambda x, y, lab: ARDGPRegressor(x, y)),
    DPKLClassifier: (
        "classifier",
        lambda x, y, lab: DPKLClassifier(
            x, lab.long(), _net(), num_particles=2, num_weight_particles=2
        ),
    ),
}
# models that train: fit runs an optimiser, predicting before it raises NotFittedError
TRAINS = {
    KernelDistillation,
    DPKLRegressor,
    SSDPKLRegressor,
    DKLRegressor,
    ARDGPRegressor,
    DPKLClassifier,
}
FIT_OPTIONS = {cls: {"max_iter": 2} for cls in TRAINS - {KernelDistillation}}
# old names that the convention replaced; none may appear in a public signature. "kernel" is
# refused for GPyTorch kernel modules, which are ``covar_module``; gpsd.linalg's engines take
# kernel matrices and operators, and name them ``kernel``.
FORBIDDEN = {
    "gamma",
    "num_epochs",
    "num_iter",
    "n_iter",
    "learning_rate",
    "net",
    "network",
    "noise_schedule",
    "n_steps",
}


def _public_classes():
    seen = {}
    for module in [gpsd, *SUBPACKAGES]:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                seen[obj] = name
    return seen


def _estimators():
    return [c for c in _public_classes() if hasattr(c, "fit") or hasattr(c, "predict")]


def _build(cls):
    x, y, labels, test_x = _data()
    kind, make = FACTORIES[cls]
    return kind, make(x, y, labels), (x, y, labels, test_x)


def _fit(model):
    if isinstance(model, SparseLowRankStudent):
        return model  # the result of KernelDistillation.fit(): fitted when it exists
    options = FIT_OPTIONS.get(type(model), {})
    return model.fit(**options)


ESTIMATORS = pytest.mark.parametrize("cls", list(FACTORIES), ids=lambda c: c.__name__)


# ---------------------------------------------------------------------------- the walk


def test_every_public_estimator_is_checked():
    missing = [c.__name__ for c in _estimators() if c not in FACTORIES]
    assert not missing, f"estimators without a convention check: {missing}"
    assert set(FACTORIES) <= set(_estimators())


def test_every_subpackage_name_is_exported_by_its_all():
    for module in [gpsd, *SUBPACKAGES]:
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_no_public_signature_uses_a_replaced_name():
    offenders = []
    for cls, name in _public_classes().items():
        for attr, member in inspect.getmembers(cls):
            if attr.startswith("_") and attr != "__init__":
                continue
            if not callable(member) or getattr(member, "__module__", "").split(".")[0] != "gpsd":
                continue
            try:
                params = inspect.signature(member).parameters
            except (TypeError, ValueError):
                continue
            offenders += [f"{name}.{attr}({p})" for p in params if p in FORBIDDEN]
            kernel = params.get("kernel")
            if kernel is not None and (cls in FACTORIES or "Kernel" in str(kernel.annotation)):
                offenders.append(f"{name}.{attr}(kernel)")
    assert not offenders, offenders


def test_num_steps_means_distillation_steps_only():
    for cls, name in _public_classes().items():
        for attr in ("__init__", "fit", "from_teacher", "from_data"):
            member = getattr(cls, attr, None)
            if member is None or attr not in vars(cls) and attr != "__init__":
                continue
            try:
                params = inspect.signature(member).parameters
            except (TypeError, ValueError):
                continue
            if "num_steps" in params:
                assert "Centric" in name, f"{name}.{attr} takes num_steps"


@ESTIMATORS
def test_constructors_take_the_data_first_then_the_modules_then_keywords(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    if cls is KernelDistillation:
        assert positional == ["teacher"]
        from_data = list(inspect.signature(cls.from_data).parameters)
        assert from_data[:3] == ["train_x", "train_y", "covar_module"]
    elif cls is SparseLowRankStudent:
        return  # built by KernelDistillation.fit(), not by users
    elif cls is ARDGPRegressor:
        assert positional == ["train_x", "train_y"]
        assert "covar_module" in inspect.signature(cls).parameters
    else:
        module = (
            "feature_extractor"
            if "DKL" in cls.__name__ or "DPKL" in cls.__name__
            else ("covar_module")
        )
        assert positional == ["train_x", "train_y", module]
    others = [p for p in params if p.kind is not p.POSITIONAL_OR_KEYWORD]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in others)


@ESTIMATORS
def test_fit_returns_the_estimator(cls):
    _, model, _ = _build(cls)
    if cls is SparseLowRankStudent:
        assert not hasattr(model, "fit")  # made by KernelDistillation.fit(), already fitted
        return
    assert _fit(model) is model


@ESTIMATORS
def test_models_that_train_refuse_to_predict_before_fit(cls):
    kind, model, (x, y, labels, test_x) = _build(cls)
    if cls not in TRAINS:
        return
    with pytest.raises(NotFittedError, match="fit"):
        if cls is KernelDistillation:
            model.student  # noqa: B018
        elif kind == "classifier":
            model.predict_proba(test_x)
        else:
            model.predict(test_x)


@ESTIMATORS
def test_iterating_fits_take_progress_and_a_callback_that_stops_them(cls):
    kind, model, _ = _build(cls)
    if cls in (CombinedGPR, DataCentricGPR, DistributionCentricGPR):
        # fit reports the growth of a Lanczos basis, where the backend grows one
        assert {"progress", "callback"} <= set(inspect.signature(model.fit).parameters)
        params = inspect.signature(model.optimize_hyperparameters).parameters
        assert {"progress", "callback", "max_iter", "lr"} <= set(params)
        records = []
        model.optimize_hyperparameters(max_iter=5, callback=lambda r: records.append(r) or True)
        assert [r.iteration for r in records] == [1]
        return
    if cls in (LaplaceGPClassifier, SparseLowRankStudent):
        target = getattr(model, "optimize_hyperparameters", None)
        if target is None:
            return  # closed form: no loop of its own
        params = inspect.signature(target).parameters
        assert {"progress", "callback", "max_iter", "lr"} <= set(params)
        records = []
        target(max_iter=5, callback=lambda r: records.append(r) or True)
        assert [r.iteration for r in records] == [1]
        return
    assert {"progress", "callback"} <= set(inspect.signature(model.fit).parameters)
    records = []
    options = {k: 5 for k in FIT_OPTIONS.get(cls, {})}
    model.fit(**options, callback=lambda r: records.append(r) or len(records) == 1)
    assert len(records) == 1 and records[0].iteration == 1
    assert isinstance(records[0], gpsd.IterationRecord)


@ESTIMATORS
def test_regressors_predict_a_latent_prediction_and_add_the_noise_on_request(cls):
    kind, model, (x, y, labels, test_x) = _build(cls)
    if "regressor" not in kind:
        return
    _fit(model)
    latent = model.predict(test_x)
    noisy = model.predict(test_x, include_noise=True)
    assert isinstance(latent, Prediction) and isinstance(noisy, Prediction)
    shape = (T, M) if kind.startswith("distiller") else (M,)
    assert latent.mean.shape == latent.variance.shape == shape
    torch.testing.assert_close(latent.stddev, latent.variance.sqrt())
    torch.testing.assert_close(noisy.mean, latent.mean)
    assert bool((noisy.variance > latent.variance).all())
    with torch.no_grad():
        dist = model(test_x)
    assert isinstance(dist, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(dist.mean.detach(), latent.mean.detach())


@ESTIMATORS
def test_distillers_count_steps_from_one_and_select_them(cls):
    kind, model, (x, y, labels, test_x) = _build(cls)
    if kind not in ("distiller-regressor", "distiller-classifier"):
        return
    assert model.num_steps == T
    if kind == "distiller-regressor":
        every = model.predict(test_x)
        for t in (1, T):
            one = model.predict(test_x, step=t)
            torch.testing.assert_close(one.mean, every.mean[t - 1])
            torch.testing.assert_close(one.variance, every.variance[t - 1])
        best = model.best_step("gcv")
        assert isinstance(best, int) and 1 <= best <= T
        assert best == int(model.gcv().argmin()) + 1
        targets = model.step_targets()
        torch.testing.assert_close(targets[0], y)
        best = model.best_step("validation", val_x=test_x, val_y=torch.sin(test_x).sum(-1))
    else:
        every = model.predict_proba(test_x)
        assert every.shape == (T, M, 2)
        torch.testing.assert_close(model.predict_proba(test_x, step=T), every[T - 1])
        latent = model.predict_latent(test_x, step=1)
        assert isinstance(latent, Prediction) and latent.mean.shape == (M,)
        best = model.best_step("validation", val_x=test_x, val_y=(test_x.sum(-1) > 4).to(DT))
    assert isinstance(best, int) and 1 <= best <= T
    for bad in (0, T + 1):
        with pytest.raises(ValueError, match="step"):
            (model.predict(test_x, step=bad))


@ESTIMATORS
def test_classifiers_give_probabilities_labels_and_the_latent(cls):
    kind, model, (x, y, labels, test_x) = _build(cls)
    if kind != "classifier":
        return
    _fit(model)
    proba = model.predict_proba(test_x)
    num_classes = 2
    assert proba.shape == (M, num_classes)
    torch.testing.assert_close(proba.sum(-1), torch.ones(M, dtype=proba.dtype))
    labels_out = model.predict(test_x)
    assert labels_out.dtype == torch.long and labels_out.shape == (M,)
    assert torch.equal(labels_out, proba.argmax(-1))
    assert isinstance(model.predict_latent(test_x), Prediction)


# ---------------------------------------------------------------------------- progress arguments


def _methods_taking_progress():
    """Every public function and method of gpsd with a ``progress`` parameter, by name."""
    found = set()
    for module in [gpsd, *SUBPACKAGES]:
        for name in module.__all__:
            obj = getattr(module, name)
            members = inspect.getmembers(obj) if inspect.isclass(obj) else [("", obj)]
            for attr, member in members:
                if attr.startswith("_") or not callable(member):
                    continue
                if getattr(member, "__module__", "").split(".")[0] != "gpsd":
                    continue
                try:
                    params = inspect.signature(member).parameters
                except (TypeError, ValueError):
                    continue
                if "progress" in params:
                    found.add(f"{name}.{attr}" if attr else name)
    return found


def _call_with_progress_arguments(name, **arguments):
    x, y, labels, test_x = _data()
    if name == "make_engine":
        request = EngineRequest(_kernel(), x, "dense", torch.Size(), T, DT, None, 1e-8, 1e-2)
        make_engine(request, **arguments)
    elif name == "kmeans":
        kmeans(x, 4, **arguments)
    elif name == "KernelSpectrum.from_lanczos":
        KernelSpectrum.from_lanczos(_kernel()(x).to_dense().detach(), rank=8, **arguments)
    else:
        owner, method = name.split(".")
        _, model, _ = _build(getattr(gpsd, owner))
        getattr(model, method)(**arguments)


PROGRESS_METHODS = [
    "make_engine",
    "KernelSpectrum.from_lanczos",
    "DataCentricGPR.fit",  # the dense path here: no loop to report
    "DistributionCentricGPR.fit",
    "CombinedGPR.fit",
    "DataCentricGPR.optimize_hyperparameters",
    "DistributionCentricGPR.optimize_hyperparameters",
    "CombinedGPR.optimize_hyperparameters",
    "LaplaceGPClassifier.optimize_hyperparameters",
    "CombinedGPC.fit",
    "DataCentricGPC.fit",
    "DistributionCentricGPC.fit",
    "KernelDistillation.fit",
    "KernelDistillation.prepare",
    "kmeans",
    "DPKLRegressor.fit",
    "SSDPKLRegressor.fit",
    "DKLRegressor.fit",
    "ARDGPRegressor.fit",
    "DPKLClassifier.fit",
]


def test_every_method_taking_progress_is_checked_below():
    assert _methods_taking_progress() == set(PROGRESS_METHODS)


@pytest.mark.parametrize("name", PROGRESS_METHODS)
@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"progress": "yes"}, "progress must be True, False or a tqdm progress bar, got str"),
        ({"callback": 5}, "callback must be callable or None, got int"),
    ],
    ids=["progress", "callback"],
)
def test_every_method_taking_progress_refuses_a_bad_progress_or_callback(name, arguments, match):
    with pytest.raises(TypeError, match=match):
        _call_with_progress_arguments(name, **arguments)
