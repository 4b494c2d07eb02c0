"""Tests of SelfDistilledGPRegressor that concern what runs beneath it (the shared behaviour of
the scikit-learn adapters is in test_adapters.py)."""

import numpy as np

import gpsd
from gpsd.sklearn import SelfDistilledGPRegressor


def test_auto_falling_back_to_cg_fits_scores_and_predicts_as_the_dense_backend():
    # backend="auto" beyond dense_max_n grows Lanczos to 8 columns, short of rtol: deflated CG
    rng = np.random.default_rng(0)
    X = rng.uniform(0, 10, (300, 3))
    y = np.sin(X).sum(1)
    test_X = rng.uniform(0, 10, (20, 3))
    options = dict(optimize_hyperparameters=False, lengthscale=0.5, num_steps=3)
    with gpsd.settings.dense_max_n(cpu=50), gpsd.settings.max_lanczos_rank(8):
        auto = SelfDistilledGPRegressor(backend="auto", **options).fit(X, y)
        mean, std = auto.predict(test_X, return_std=True)
    dense = SelfDistilledGPRegressor(backend="dense", **options).fit(X, y)
    # the scores are estimated from probes (a positive standard error), the dense ones exact
    assert np.all(auto.gcv_standard_error_ > 0) and np.all(dense.gcv_standard_error_ == 0)
    assert auto.step_ == int(np.argmin(auto.gcv_)) + 1
    np.testing.assert_allclose(auto.gcv_, dense.gcv_, rtol=0.1)
    dense.step_ = auto.step_  # the same step, for the predictions
    expected_mean, expected_std = dense.predict(test_X, return_std=True)
    np.testing.assert_allclose(mean, expected_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(std, expected_std, rtol=1e-5, atol=1e-6)
