"""The papers' toy settings: seeded, checked arguments."""

import pytest
import torch

from gpsd.data import (
    damped_sine_regression,
    kernel_reconstruction_inputs,
    sine_classification,
    xsinx_regression,
)


def test_toy_settings_are_seeded():
    x, y = xsinx_regression(seed=1)
    assert x.shape == (10,) and float(x[0]) == 0.0 and float(x[-1]) == 10.0
    torch.testing.assert_close(y, xsinx_regression(seed=1)[1])
    x, y, xt = sine_classification(n=40, seed=2)
    assert ((x >= 0) & (x <= 5)).all() and set(y.tolist()) <= {0.0, 1.0} and xt.shape == (90,)
    xr = kernel_reconstruction_inputs()
    assert xr.shape == (1000, 1) and (xr[1:] >= xr[:-1]).all()
    xd, yd = damped_sine_regression()
    assert xd.shape == (1000, 1) and yd.shape == (1000,)


@pytest.mark.parametrize(
    "make, kwargs, name",
    [(xsinx_regression, {"n": -1}, "n"), (xsinx_regression, {"noise_std": -1.0}, "noise_std"),
     (xsinx_regression, {"noise_std": float("nan")}, "noise_std"),
     (sine_classification, {"n": 2.5}, "n"), (kernel_reconstruction_inputs, {"seed": -3}, "seed"),
     (damped_sine_regression, {"dtype": torch.int64}, "dtype")],
)  # fmt: skip
def test_toy_settings_reject_bad_arguments(make, kwargs, name):
    # each bad argument is named, none passes to torch or returns data
    with pytest.raises(ValueError, match=name):
        make(**kwargs)
