"""Tests of what the shifted-solve engines share (gpsd.linalg._shifted_solve): one solve per
distinct shift, reused while its right-hand side is unchanged."""

import torch
from gpr_reference import rbf_gram

from gpsd.linalg import KernelSpectrum, ShiftedCholesky, SpectralFilter

DTYPE = torch.float64


def test_one_solve_per_data_centric_step_under_inference_mode(count_calls):
    """A step needs (K + g I)^-1 f twice (weights and targets): the solve is shared, also for
    inference tensors, which keep no write counters."""
    gen = torch.Generator().manual_seed(9)
    k = rbf_gram(10 * torch.rand(30, 1, generator=gen, dtype=DTYPE))
    rhs = torch.randn(30, 1, generator=gen, dtype=DTYPE)
    filt = SpectralFilter.data_centric_weights(torch.tensor([0.1, 0.2, 0.3], dtype=DTYPE), 0.25)
    expected = KernelSpectrum.from_dense(k).apply(filt, rhs)
    for context in (torch.no_grad, torch.inference_mode):
        engine = ShiftedCholesky(k)
        solves = count_calls(engine, "_solve")
        with context():
            got = engine.apply(filt, rhs.clone())
        assert solves[0] == 3, context.__name__
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
