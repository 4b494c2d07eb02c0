"""scikit-learn estimators over gpsd's GPyTorch models.

Each class here is a thin adapter: hyperparameters in ``__init__``, ``fit(X, y)`` on NumPy arrays,
``predict`` (and ``predict_proba`` for the classifier) returning NumPy arrays, so that gpsd works
inside ``Pipeline``, ``GridSearchCV`` and ``cross_val_score``. The fitted GPyTorch model is the
attribute ``model_`` (``distiller_`` and ``student_`` for kernel distillation).

This package needs scikit-learn (``pip install "gpsd[sklearn]"``); ``import gpsd`` does not load
it.
"""

try:
    import sklearn  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "gpsd.sklearn needs scikit-learn; install the extra with: pip install 'gpsd[sklearn]'"
    ) from err

from gpsd.sklearn.deep_probabilistic_kernel_regressor import DeepProbabilisticKernelRegressor
from gpsd.sklearn.kernel_distilled_regressor import KernelDistilledRegressor
from gpsd.sklearn.self_distilled_gp_classifier import SelfDistilledGPClassifier
from gpsd.sklearn.self_distilled_gp_regressor import SelfDistilledGPRegressor

__all__ = [
    "DeepProbabilisticKernelRegressor",
    "KernelDistilledRegressor",
    "SelfDistilledGPClassifier",
    "SelfDistilledGPRegressor",
]
