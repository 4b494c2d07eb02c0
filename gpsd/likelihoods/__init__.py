"""Likelihoods for GP models: the continuous Bernoulli for soft targets in [0, 1] and the
continuous categorical for soft targets on the simplex (K classes)."""

from gpsd.likelihoods.cc_log_normalizer import cc_log_normalizer, cc_mean
from gpsd.likelihoods.continuous_bernoulli import ContinuousBernoulli
from gpsd.likelihoods.continuous_bernoulli_likelihood import ContinuousBernoulliLikelihood
from gpsd.likelihoods.continuous_categorical import ContinuousCategorical
from gpsd.likelihoods.continuous_categorical_likelihood import ContinuousCategoricalLikelihood
from gpsd.likelihoods.log_normalizer import (
    cb_entropy,
    cb_log_density,
    cb_log_normalizer,
    cb_mean,
    cb_variance,
    log_cb_normalizing_constant,
    log_cb_normalizing_constant_grad,
    log_cb_normalizing_constant_hessian,
)

__all__ = [
    "ContinuousBernoulli",
    "ContinuousBernoulliLikelihood",
    "ContinuousCategorical",
    "ContinuousCategoricalLikelihood",
    "cb_entropy",
    "cb_log_density",
    "cb_log_normalizer",
    "cb_mean",
    "cb_variance",
    "cc_log_normalizer",
    "cc_mean",
    "log_cb_normalizing_constant",
    "log_cb_normalizing_constant_grad",
    "log_cb_normalizing_constant_hessian",
]
