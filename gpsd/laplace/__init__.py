"""Laplace approximation for binary GP classification with any log-concave 1-D likelihood."""

from gpsd.exceptions import LaplaceConvergenceError
from gpsd.laplace.autograd_terms import AutogradLikelihoodTerms
from gpsd.laplace.bernoulli_logit_terms import BernoulliLogitTerms
from gpsd.laplace.bernoulli_probit_terms import BernoulliProbitTerms
from gpsd.laplace.continuous_bernoulli_terms import ContinuousBernoulliTerms
from gpsd.laplace.continuous_categorical_terms import ContinuousCategoricalTerms
from gpsd.laplace.laplace_gp_classifier import LaplaceGPClassifier
from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms
from gpsd.laplace.marginal_likelihood import differentiable_mode, laplace_log_marginal_likelihood
from gpsd.laplace.multiclass_laplace_posterior import MulticlassLaplacePosterior
from gpsd.laplace.multiclass_likelihood_terms import MulticlassLikelihoodTerms
from gpsd.laplace.newton import LaplaceMode, find_laplace_mode
from gpsd.laplace.predictive import (
    binary_class_probabilities,
    closed_form_probability,
    expected_response,
    gauss_hermite_expectation,
    laplace_latent_predictive,
    probit_approximation,
    symmetric_response_expectation,
)
from gpsd.laplace.resolve import resolve_likelihood_terms
from gpsd.laplace.softmax_terms import SoftmaxTerms

__all__ = [
    "AutogradLikelihoodTerms",
    "BernoulliLogitTerms",
    "BernoulliProbitTerms",
    "ContinuousBernoulliTerms",
    "ContinuousCategoricalTerms",
    "LaplaceConvergenceError",
    "LaplaceGPClassifier",
    "LaplaceLikelihoodTerms",
    "LaplaceMode",
    "MulticlassLaplacePosterior",
    "MulticlassLikelihoodTerms",
    "SoftmaxTerms",
    "binary_class_probabilities",
    "closed_form_probability",
    "differentiable_mode",
    "find_laplace_mode",
    "expected_response",
    "gauss_hermite_expectation",
    "laplace_latent_predictive",
    "laplace_log_marginal_likelihood",
    "probit_approximation",
    "resolve_likelihood_terms",
    "symmetric_response_expectation",
]
