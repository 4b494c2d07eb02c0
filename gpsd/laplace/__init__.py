"""Laplace approximations for GP classification: binary, with any log-concave 1-D likelihood, and
multiclass, with the softmax or the continuous categorical."""

from gpsd.exceptions import LaplaceConvergenceError
from gpsd.laplace.autograd_terms import AutogradLikelihoodTerms
from gpsd.laplace.bernoulli_logit_terms import BernoulliLogitTerms
from gpsd.laplace.bernoulli_probit_terms import BernoulliProbitTerms
from gpsd.laplace.continuous_bernoulli_terms import ContinuousBernoulliTerms
from gpsd.laplace.continuous_categorical_terms import ContinuousCategoricalTerms
from gpsd.laplace.laplace_gp_classifier import LaplaceGPClassifier
from gpsd.laplace.laplace_posterior import LaplacePosterior
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
    multiclass_expectation,
    probit_approximation,
    symmetric_response_expectation,
)
from gpsd.laplace.prior import constant_parameters, prior_at_test, prior_at_training
from gpsd.laplace.resolve import likelihood_module, resolve_likelihood_terms
from gpsd.laplace.softmax_terms import SoftmaxTerms
from gpsd.laplace.tempered_softmax_terms import TemperedSoftmaxTerms
from gpsd.laplace.training_data import ClassificationTrainingData, checked_classification_data

__all__ = [
    "AutogradLikelihoodTerms",
    "BernoulliLogitTerms",
    "BernoulliProbitTerms",
    "ClassificationTrainingData",
    "ContinuousBernoulliTerms",
    "ContinuousCategoricalTerms",
    "LaplaceConvergenceError",
    "LaplaceGPClassifier",
    "LaplaceLikelihoodTerms",
    "LaplaceMode",
    "LaplacePosterior",
    "MulticlassLaplacePosterior",
    "MulticlassLikelihoodTerms",
    "SoftmaxTerms",
    "TemperedSoftmaxTerms",
    "binary_class_probabilities",
    "checked_classification_data",
    "closed_form_probability",
    "constant_parameters",
    "differentiable_mode",
    "find_laplace_mode",
    "expected_response",
    "gauss_hermite_expectation",
    "laplace_latent_predictive",
    "laplace_log_marginal_likelihood",
    "likelihood_module",
    "multiclass_expectation",
    "prior_at_test",
    "prior_at_training",
    "probit_approximation",
    "resolve_likelihood_terms",
    "symmetric_response_expectation",
]
