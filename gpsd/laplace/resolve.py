"""Map a likelihood argument (name, GPyTorch likelihood or terms) to Laplace likelihood terms."""

from __future__ import annotations

import torch
from gpytorch.likelihoods import BernoulliLikelihood, Likelihood

from gpsd.laplace.autograd_terms import AutogradLikelihoodTerms
from gpsd.laplace.bernoulli_logit_terms import BernoulliLogitTerms
from gpsd.laplace.bernoulli_probit_terms import BernoulliProbitTerms
from gpsd.laplace.continuous_bernoulli_terms import ContinuousBernoulliTerms
from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms
from gpsd.likelihoods.continuous_bernoulli_likelihood import ContinuousBernoulliLikelihood

__all__ = ["LIKELIHOOD_NAMES", "likelihood_module", "resolve_likelihood_terms"]

LIKELIHOOD_NAMES = {
    "bernoulli_logit": BernoulliLogitTerms,
    "logit": BernoulliLogitTerms,
    "logistic": BernoulliLogitTerms,
    "bernoulli_probit": BernoulliProbitTerms,
    "probit": BernoulliProbitTerms,
    "continuous_bernoulli": ContinuousBernoulliTerms,
}


def resolve_likelihood_terms(likelihood: object) -> LaplaceLikelihoodTerms:
    """Return Laplace likelihood terms for a name, a GPyTorch likelihood, or terms.

    Names: ``"bernoulli_logit"`` (``"logit"``, ``"logistic"``), ``"bernoulli_probit"``
    (``"probit"``), ``"continuous_bernoulli"``. :class:`~gpsd.ContinuousBernoulliLikelihood` and
    GPyTorch's ``BernoulliLikelihood`` (probit link) get closed-form terms; any other GPyTorch
    likelihood is differentiated by autograd.
    """
    if isinstance(likelihood, LaplaceLikelihoodTerms):
        return likelihood
    if isinstance(likelihood, str):
        key = likelihood.lower()
        if key not in LIKELIHOOD_NAMES:
            raise ValueError(
                f"likelihood must be one of {sorted(LIKELIHOOD_NAMES)}, a gpytorch Likelihood or "
                f"LaplaceLikelihoodTerms, got {likelihood!r}"
            )
        return LIKELIHOOD_NAMES[key]()
    if isinstance(likelihood, ContinuousBernoulliLikelihood):
        return ContinuousBernoulliTerms()
    if isinstance(likelihood, BernoulliLikelihood):
        return BernoulliProbitTerms()
    if isinstance(likelihood, Likelihood):
        return AutogradLikelihoodTerms(likelihood)
    raise TypeError(
        "likelihood must be a name, a gpytorch Likelihood or LaplaceLikelihoodTerms, "
        f"got {type(likelihood)}"
    )


def likelihood_module(likelihood: object, terms: LaplaceLikelihoodTerms) -> torch.nn.Module | None:
    """The module whose parameters a classifier built with ``likelihood`` (resolved to ``terms``)
    must register, so that they train with the kernel's and a change of them refits: the
    likelihood itself when it is a module, the wrapped one of :class:`AutogradLikelihoodTerms`,
    else ``None``."""
    if isinstance(likelihood, torch.nn.Module):
        return likelihood
    if isinstance(terms, AutogradLikelihoodTerms):
        return terms.likelihood
    return None
