"""Prediction under ``torch.inference_mode()``, a common way to predict without a graph.

Inference tensors keep no version counter: the shifted-solve backends read it to reuse a solve
and raised "Inference tensors do not track version counter" (Cholesky, CG and auto backends).
"""

import pytest
import torch
from gpr_reference import rbf_kernel

from gpsd import DataCentricGPR, DistributionCentricGPR

DT = torch.float64


def _data():
    gen = torch.Generator().manual_seed(3)
    x = 10 * torch.rand(40, 1, generator=gen, dtype=DT)
    return x, torch.sin(x[:, 0]), torch.linspace(0, 10, 9, dtype=DT).unsqueeze(-1)


@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg", "auto"])
@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_predictions_under_inference_mode_equal_those_under_no_grad(cls, backend):
    x, y, test_x = _data()
    gamma = [0.1, 0.2, 0.1]
    with torch.no_grad():
        expected = cls(x, y, rbf_kernel(), noise=gamma, backend=backend).predict(test_x)
    model = cls(x, y, rbf_kernel(), noise=gamma, backend=backend)
    with torch.inference_mode():
        first = model.predict(test_x)
        again = model.predict(test_x)  # from the cached factorisation
    for got in (first, again):
        torch.testing.assert_close(got.mean, expected.mean, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(got.variance, expected.variance, rtol=1e-9, atol=1e-11)


def test_a_model_built_and_used_under_inference_mode():
    x, y, test_x = _data()
    with torch.no_grad():
        expected = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="cg").predict(
            test_x
        )
    with torch.inference_mode():
        got = DataCentricGPR(x.clone(), y.clone(), rbf_kernel(), noise=[0.1, 0.2], backend="cg")
        got = got.predict(test_x)
    torch.testing.assert_close(got.mean, expected.mean, rtol=1e-7, atol=1e-9)
