"""Tests of what the shifted-solve engines share (gpsd.linalg._shifted_solve): one solve per
distinct shift, reused while its right-hand side is unchanged."""

import torch

from gpsd.linalg import KernelSpectrum, ShiftedCholesky, SpectralFilter

DTYPE = torch.float64


def _rbf(x, lengthscale=1.0):
    return torch.exp(-0.5 * (x - x.mT).square() / lengthscale**2)


def _counting(monkeypatch, module, name):
    calls = [0]
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_one_solve_per_data_centric_step_under_inference_mode(monkeypatch):
    """A step needs (K + g I)^-1 f twice (weights and targets): the solve is shared, also for
    inference tensors, which keep no write counters."""
    gen = torch.Generator().manual_seed(9)
    k = _rbf(10 * torch.rand(30, 1, generator=gen, dtype=DTYPE))
    rhs = torch.randn(30, 1, generator=gen, dtype=DTYPE)
    filt = SpectralFilter.data_centric_weights(torch.tensor([0.1, 0.2, 0.3], dtype=DTYPE), 0.25)
    expected = KernelSpectrum.from_dense(k).apply(filt, rhs)
    for context in (torch.no_grad, torch.inference_mode):
        engine = ShiftedCholesky(k)
        solves = _counting(monkeypatch, engine, "_solve")
        with context():
            got = engine.apply(filt, rhs.clone())
        assert solves[0] == 3, context.__name__
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
