"""scikit-learn's own estimator checks on every estimator of gpsd.sklearn."""

import pytest

pytest.importorskip("sklearn")

from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from gpsd.sklearn import (  # noqa: E402
    DeepProbabilisticKernelRegressor,
    KernelDistilledRegressor,
    SelfDistilledGPClassifier,
    SelfDistilledGPRegressor,
)

ESTIMATORS = [
    SelfDistilledGPRegressor(),
    # few Adam iterations: the multiclass checks fit 300 points of 3 classes several times
    SelfDistilledGPClassifier(max_iter=5),
    KernelDistilledRegressor(random_state=0),
    DeepProbabilisticKernelRegressor(random_state=0),
]


@parametrize_with_checks(ESTIMATORS)
def test_sklearn_compatible_estimator(estimator, check):
    check(estimator)
