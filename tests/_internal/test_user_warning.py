"""Warnings point at the user's line: the first frame outside gpsd (and torch, GPyTorch)."""

import linecache
import warnings

import gpytorch
import torch
from gpr_reference import rbf_kernel
from gpytorch.utils.warnings import NumericalWarning
from kd_reference import line_distiller

from gpsd import DataCentricGPR
from gpsd._internal.user_warning import warn


def _caught(action, category):
    """The warnings of ``category`` that ``action()`` issues."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [w for w in caught if issubclass(w.category, category)]


def _assert_points_at_this_file(found, call):
    assert found, "no warning"
    for w in found:
        assert w.filename == __file__, w.filename
        assert call in linecache.getline(w.filename, w.lineno)


def test_a_warning_called_from_here_names_this_line():
    found = _caught(lambda: warn("careful", UserWarning), UserWarning)
    _assert_points_at_this_file(found, 'warn("careful", UserWarning)')


def _float32_model():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 1, generator=gen)
    y = torch.sin(6 * x.squeeze(-1))
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    # noise far below float32's rounding of K: the factorisation warns
    return DataCentricGPR(x, y, kernel, noise=[1e-6], backend="cholesky", linalg_dtype=None)


def test_a_warning_from_a_lazy_factorisation_names_the_users_predict():
    model, test_x = _float32_model(), torch.rand(5, 1)
    with torch.no_grad():
        found = _caught(lambda: model.predict_mean(test_x), NumericalWarning)
    _assert_points_at_this_file(found, "model.predict_mean(test_x)")


def test_a_warning_reached_through_a_module_call_names_the_users_call():
    model, test_x = _float32_model(), torch.rand(5, 1)
    with torch.no_grad():
        found = _caught(lambda: model(test_x), NumericalWarning)  # through GPyTorch's __call__
    _assert_points_at_this_file(found, "model(test_x)")


def test_a_warning_from_deep_in_a_prediction_names_the_users_predict():
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(40, 1, generator=gen, dtype=torch.float64)
    model = DataCentricGPR(x, torch.sin(6 * x.squeeze(-1)), rbf_kernel(), noise=[0.1])
    test_x = torch.rand(7, 1, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        engine = model.fit()._current_fit().engine
        reduction = engine.quad_diag
        engine.quad_diag = lambda *args: 2 * reduction(*args) + 1.0  # negative variances
        found = _caught(lambda: model.predict(test_x), NumericalWarning)
    _assert_points_at_this_file(found, "model.predict(test_x)")


def test_a_warning_of_kernel_distillation_names_the_users_fit():
    distiller = line_distiller(lr=0.1)  # a fixed step too large: the error grows
    found = _caught(lambda: distiller.fit(), RuntimeWarning)
    _assert_points_at_this_file(found, "distiller.fit()")


def test_gpsd_warns_through_the_one_helper_only():
    import pathlib

    import gpsd

    root = pathlib.Path(gpsd.__file__).parent
    helper = root / "_internal" / "user_warning.py"
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path != helper
        and ("warnings.warn(" in (text := path.read_text()) or "stacklevel" in text)
    ]
    assert not offenders, f"warn through gpsd._internal.user_warning.warn: {offenders}"
