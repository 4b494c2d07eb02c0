"""A frozen copy of a trained exact GP's posterior: the shared state of PosteriorMean/Kernel."""

from __future__ import annotations

import copy

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.likelihoods import _GaussianLikelihoodBase
from gpytorch.models import ExactGP
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor

from gpsd._internal.validation import check_finite, check_matrix, check_vector
from gpsd.exceptions import TeacherError


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


def validate_teacher(
    teacher: object,
    likelihood_type: type,
    likelihood_name: str,
    *,
    batch: bool = True,
    needs_mean: bool = True,
) -> tuple[Tensor, Tensor]:
    """The one check of a teacher, for every model built from one: a GPyTorch ``ExactGP`` whose
    likelihood is a ``likelihood_type`` (called ``likelihood_name`` in the message), with one
    training input tensor ``(*b, n, d)`` (or ``(n,)``), finite targets ``(*b, n)``,
    ``covar_module`` (a GPyTorch kernel) and, with ``needs_mean``, ``mean_module``; without
    ``batch``, unbatched training data. Any fault raises a :class:`~gpsd.TeacherError` naming the
    attribute of ``teacher`` at fault.

    :return: The training inputs ``(*b, n, d)`` and targets ``(*b, n)``, detached.
    """
    if not isinstance(teacher, ExactGP):
        raise TeacherError(
            f"teacher must be a gpytorch.models.ExactGP, got {type(teacher).__name__}"
        )
    if not isinstance(teacher.likelihood, likelihood_type):
        raise TeacherError(
            f"teacher.likelihood must be {likelihood_name}, got {type(teacher.likelihood).__name__}"
        )
    if teacher.train_inputs is None or teacher.train_targets is None:
        raise TeacherError("teacher has no training data: call teacher.set_train_data(x, y) first")
    if len(teacher.train_inputs) != 1:
        raise TeacherError(
            "teacher.train_inputs must hold exactly one training input tensor, got "
            f"{len(teacher.train_inputs)}"
        )
    try:
        train_x = check_matrix(teacher.train_inputs[0], "teacher.train_inputs[0]", nonempty=True)
        train_y = check_vector(teacher.train_targets, "teacher.train_targets", n=train_x.shape[-2])
    except ValueError as err:
        raise TeacherError(str(err)) from None
    if not batch and (train_x.dim() != 2 or train_y.dim() != 1):
        raise TeacherError(
            "teacher.train_inputs and teacher.train_targets must have no batch shape, (n, d) "
            f"and (n,), got {tuple(train_x.shape)} and {tuple(train_y.shape)}"
        )
    if not isinstance(getattr(teacher, "covar_module", None), Kernel):
        raise TeacherError(
            "teacher.covar_module must be a gpytorch.kernels.Kernel (the GPyTorch convention: "
            "the teacher keeps its kernel there)"
        )
    if needs_mean and not isinstance(getattr(teacher, "mean_module", None), gpytorch.Module):
        raise TeacherError("teacher.mean_module must be a GPyTorch mean (the GPyTorch convention)")
    return train_x.detach(), train_y.detach()


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
