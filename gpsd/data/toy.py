"""The papers' synthetic settings, generated with fixed seeds.

* :func:`xsinx_regression`: Borup & Andersen §3.3 (Fig. 3, 8, 9).
* :func:`sine_classification`: Borup & Andersen §4.3 (Fig. 4-6, 10).
* :func:`kernel_reconstruction_inputs`: Song & Sun Appendix B (Fig. 2).
* :func:`damped_sine_regression`: Song & Sun Appendix B (Fig. 3).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gpsd._internal.validation import check_int, check_positive_float

__all__ = [
    "damped_sine_regression",
    "kernel_reconstruction_inputs",
    "sine_classification",
    "xsinx_regression",
]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check(n: object, seed: object, dtype: object) -> tuple[int, int]:
    """``n`` (a positive integer), ``seed`` (a non-negative integer) and a floating ``dtype``,
    or a ``ValueError`` naming the argument."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return check_int(n, "n"), check_int(seed, "seed", minimum=0)


def xsinx_regression(
    n: int = 10, seed: int = 0, noise_std: float = 1.0, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """``n`` equally spaced inputs on [0, 10] and ``y = x sin x + eps``, ``eps ~ N(0, noise_std^2)``."""
    n, seed = _check(n, seed, dtype)
    noise_std = check_positive_float(noise_std, "noise_std", allow_zero=True)
    x = torch.linspace(0.0, 10.0, n, dtype=dtype)
    eps = torch.randn(n, generator=_generator(seed), dtype=dtype)
    return x, x * torch.sin(x) + noise_std * eps


def sine_classification(
    n: int = 50, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs ``x ~ U(0, 5)``, labels ``y ~ Bernoulli(sigmoid(g(x)))``, ``g(x) = 2 sin(pi x / 2)``.

    Returns ``(x, y, test_x)`` with ``test_x`` the 90 equally spaced points on [-2, 7].
    """
    n, seed = _check(n, seed, dtype)
    gen = _generator(seed)
    x = 5.0 * torch.rand(n, generator=gen, dtype=dtype)
    p = torch.sigmoid(2.0 * torch.sin(math.pi * x / 2.0))
    y = torch.bernoulli(p, generator=gen)
    return x, y, torch.linspace(-2.0, 7.0, 90, dtype=dtype)


def kernel_reconstruction_inputs(
    n: int = 1000, seed: int = 0, dtype: torch.dtype = torch.float64
) -> Tensor:
    """``n`` sorted inputs from N(0, 25), shape ``(n, 1)``."""
    n, seed = _check(n, seed, dtype)
    x = 5.0 * torch.randn(n, generator=_generator(seed), dtype=dtype)
    return x.sort().values.unsqueeze(-1)


def damped_sine_regression(
    n: int = 1000, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """``x ~ U(-10, 10)``, ``y = sin(x) exp(-x^2 / (2 * 5^2)) + eps``, ``eps ~ N(0, 1)``; x is (n, 1)."""
    n, seed = _check(n, seed, dtype)
    gen = _generator(seed)
    x = 20.0 * torch.rand(n, generator=gen, dtype=dtype) - 10.0
    f = torch.sin(x) * torch.exp(-(x**2) / (2.0 * 25.0))
    y = f + torch.randn(n, generator=gen, dtype=dtype)
    return x.unsqueeze(-1), y
