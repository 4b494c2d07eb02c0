r"""Any 1-D GPyTorch likelihood for the Laplace engine, with derivatives by autograd."""

from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor

from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms

__all__ = ["AutogradLikelihoodTerms"]


class AutogradLikelihoodTerms(LaplaceLikelihoodTerms):
    r"""Wraps a GPyTorch likelihood (``likelihood.forward(f).log_prob(y)``) and differentiates it.

    Because the observations are conditionally independent, :math:`\partial_f \ell` and
    :math:`\partial_f^2 \ell` are the autograd gradients of :math:`\sum_i \ell(y_i, f_i)` and of
    :math:`\sum_i \partial_{f_i} \ell(y_i, f_i)`. The graph is kept so that the Laplace log marginal
    likelihood can differentiate once more. The likelihood must be log-concave in :math:`f`.

    :param likelihood: A GPyTorch likelihood whose ``forward(f)`` returns a distribution with
        ``log_prob(y)`` elementwise.
    :param response: The class probability as a function of :math:`f` (default: logistic).
    :param symmetric_response: Whether :math:`r(-f) = 1 - r(f)` (default: true for the logistic
        default, false for a given ``response``); see
        :attr:`~gpsd.laplace.LaplaceLikelihoodTerms.symmetric_response`.
    :param target_check: An optional callable ``(y, name) -> None`` raising for invalid targets.
    """

    name = "autograd"

    def __init__(
        self,
        likelihood: Likelihood,
        response: Callable[[Tensor], Tensor] | None = None,
        target_check: Callable[[Tensor, str], None] | None = None,
        symmetric_response: bool | None = None,
    ) -> None:
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood)}")
        for arg, value in (("response", response), ("target_check", target_check)):
            if value is not None and not callable(value):
                raise TypeError(f"{arg} must be callable or None, got {type(value)}")
        self.likelihood = likelihood
        self._response = response if response is not None else torch.sigmoid
        if symmetric_response is None:
            symmetric_response = response is None
        self.symmetric_response = bool(symmetric_response)
        self._target_check = target_check
        self.name = type(likelihood).__name__

    def log_prob(self, y: Tensor, f: Tensor) -> Tensor:
        return self.likelihood.forward(f).log_prob(y)

    def derivatives(self, y: Tensor, f: Tensor) -> tuple[Tensor, Tensor]:
        with torch.enable_grad():
            f_in = f if f.requires_grad else f.detach().requires_grad_(True)
            lp = self.log_prob(y, f_in)
            (d1,) = torch.autograd.grad(lp.sum(), f_in, create_graph=True)
            if d1.requires_grad:
                (d2,) = torch.autograd.grad(d1.sum(), f_in, create_graph=True, allow_unused=True)
            else:
                d2 = None
            if d2 is None:  # log p is linear in f
                d2 = torch.zeros_like(f_in)
        if not torch.is_grad_enabled():  # Newton: values only; otherwise keep the graph to the
            d1, d2 = d1.detach(), d2.detach()  # likelihood's parameters and to f
        return d1, d2

    def response(self, f: Tensor) -> Tensor:
        return self._response(f)

    def check_targets(self, y: Tensor, name: str = "train_y") -> None:
        if not torch.isfinite(y).all():
            raise ValueError(f"{name} must be finite, but it holds NaN or infinite values")
        if self._target_check is not None:
            self._target_check(y, name)
