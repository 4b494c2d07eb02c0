"""A frozen copy of a trained exact GP's posterior: the shared state of PosteriorMean/Kernel."""

from __future__ import annotations

import copy

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import _GaussianLikelihoodBase
from gpytorch.models import ExactGP
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor

from gpsd._internal.validation import check_finite, check_matrix, check_vector


def frozen_copy(module: gpytorch.Module) -> gpytorch.Module:
    """A deep copy of ``module`` whose parameters do not require gradients."""
    clone = copy.deepcopy(module)
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone.eval()


def buffered_copy(module: gpytorch.Module) -> gpytorch.Module:
    """A deep copy of ``module`` in evaluation mode whose parameters are buffers: constants that
    ``parameters()`` does not list (so an optimiser of a model holding the copy never sees them)
    but ``state_dict()``, ``.to()`` and ``copy.deepcopy`` carry."""
    clone = copy.deepcopy(module)
    for submodule in clone.modules():
        for name, parameter in list(submodule._parameters.items()):
            if parameter is None:
                continue
            del submodule._parameters[name]
            submodule.register_buffer(name, parameter.detach())
    return clone.eval()


def set_mode_keeping_copies(module: gpytorch.Module, mode: bool) -> gpytorch.Module:
    """``module.train(mode)`` for a module whose children are all copies of a teacher's modules
    (:func:`frozen_copy`, :func:`buffered_copy`):
    only the module's own mode changes (and its caches are cleared as GPyTorch does).

    The copies stay in evaluation mode (an ``InducingPointKernel`` or a ``GridKernel`` evaluates
    differently in training mode), and are not visited: a chain of posterior modules would
    otherwise be walked once per level.
    """
    if not isinstance(mode, bool):
        raise ValueError("training mode is expected to be boolean")
    if mode or module.training:
        module._clear_cache()
    module.training = mode
    return module


def validate_teacher(teacher: ExactGP, likelihood_type: type, likelihood_name: str) -> None:
    """A trained GPyTorch ``ExactGP`` with training data, ``mean_module`` and ``covar_module``."""
    if not isinstance(teacher, ExactGP):
        raise TypeError(f"teacher must be a gpytorch.models.ExactGP, got {type(teacher).__name__}")
    if not isinstance(teacher.likelihood, likelihood_type):
        raise ValueError(
            f"teacher.likelihood must be {likelihood_name}, got {type(teacher.likelihood).__name__}"
        )
    if teacher.train_inputs is None or teacher.train_targets is None:
        raise ValueError("teacher has no training data: call teacher.set_train_data(x, y) first")
    if len(teacher.train_inputs) != 1:
        raise ValueError("teacher must have exactly one training input tensor")
    train_x = check_matrix(teacher.train_inputs[0], "teacher.train_inputs[0]", nonempty=True)
    check_vector(teacher.train_targets, "teacher.train_targets", n=train_x.shape[-2])
    for name in ("mean_module", "covar_module"):
        if not isinstance(getattr(teacher, name, None), gpytorch.Module):
            raise ValueError(f"teacher must define {name} (the GPyTorch convention)")


def teacher_posterior(teacher: ExactGP) -> dict[str, object]:
    r"""Everything needed to evaluate a trained teacher's posterior at new inputs.

    Returns copies of the teacher's ``mean_module`` and ``covar_module`` whose parameters are
    buffers (:func:`buffered_copy`), its training
    inputs :math:`\mathbf X`, the Cholesky factor :math:`\mathbf L` of
    :math:`\mathbf K_{XX} + \boldsymbol\Sigma_\text{noise}` and
    :math:`\mathbf a = (\mathbf K_{XX} + \boldsymbol\Sigma_\text{noise})^{-1}(\mathbf y - m(\mathbf X))`.
    """
    validate_teacher(teacher, _GaussianLikelihoodBase, "a Gaussian likelihood")
    mean_module = buffered_copy(teacher.mean_module)
    covar_module = buffered_copy(teacher.covar_module)
    x = teacher.train_inputs[0].detach()
    y = teacher.train_targets.detach()
    with torch.no_grad():
        prior_mean = mean_module(x)
        prior = MultivariateNormal(prior_mean, covar_module(x))
        marginal = teacher.likelihood.marginal(prior, x)
        covariance = marginal.covariance_matrix
        chol = psd_safe_cholesky(covariance)
        weights = torch.cholesky_solve((y - prior_mean).unsqueeze(-1), chol).squeeze(-1)
    return {
        "mean_module": mean_module,
        "covar_module": covar_module,
        "train_inputs": x,
        "cholesky": chol,
        "weights": weights,
    }


def check_inputs(x: Tensor, train_inputs: Tensor, name: str = "x") -> Tensor:
    """``x`` in the dtype of the teacher's training inputs, after checking that it has their
    device and feature dimension and a dtype that the factorisation holds without losing digits
    (float32 inputs to a float64 teacher are promoted; float64 inputs to a float32 teacher are
    refused)."""
    if torch.promote_types(x.dtype, train_inputs.dtype) != train_inputs.dtype:
        raise ValueError(
            f"{name} has dtype {x.dtype} but the teacher's factorisation is {train_inputs.dtype}; "
            f"pass {train_inputs.dtype} inputs or convert the module with .to({x.dtype})"
        )
    if x.device != train_inputs.device:
        raise ValueError(
            f"{name} is on {x.device} but the teacher's factorisation is on "
            f"{train_inputs.device}; move the module with .to(device)"
        )
    if x.shape[-1] != train_inputs.shape[-1]:
        raise ValueError(
            f"{name} must have {train_inputs.shape[-1]} features like the teacher's training "
            f"inputs, got shape {tuple(x.shape)}"
        )
    return check_finite(x.to(train_inputs.dtype), name)
