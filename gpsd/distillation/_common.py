"""Shared plumbing of the distillers: validation, students, batches."""

from __future__ import annotations

import copy
import operator

import gpytorch
import torch
from gpytorch.constraints import GreaterThan
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ExactGP
from gpytorch.utils.warnings import NumericalWarning
from linear_operator import to_dense
from torch import Tensor

from gpsd._internal.module_state import checked_setting
from gpsd._internal.teacher import validate_teacher
from gpsd._internal.user_warning import warn
from gpsd._internal.validation import (
    as_float_tensor,
    check_finite,
    check_matrix,
    check_vector,
)


def check_alpha(value: object) -> float:
    r"""The weight :math:`\alpha \in [0, 1)` of the original targets in a data-centric step's
    targets, as a float; a ``ValueError`` naming ``alpha`` otherwise."""
    alpha = float(value)
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must lie in [0, 1), got {alpha}")
    return alpha


#: the ``alpha`` of the distillers with data-centric steps, checked when set
alpha_setting = checked_setting(
    "alpha",
    check_alpha,
    r"The weight :math:`\alpha \in [0, 1)` of the original targets, checked when set.",
)


def validate_training_data(train_x: object, train_y: object) -> tuple[Tensor, Tensor]:
    """``train_x`` as ``(*b, N, d)`` and ``train_y`` as ``(*b, N)``, finite, matching N."""
    train_x = as_float_tensor(train_x, "train_x")
    train_y = as_float_tensor(train_y, "train_y", dtype=train_x.dtype, device=train_x.device)
    train_x = check_matrix(train_x, "train_x", nonempty=True)
    train_y = check_vector(train_y, "train_y", n=train_x.shape[-2])
    try:
        torch.broadcast_shapes(train_x.shape[:-2], train_y.shape[:-1])
    except RuntimeError:
        raise ValueError(
            f"the batch shapes of train_x {tuple(train_x.shape)} and train_y "
            f"{tuple(train_y.shape)} must broadcast"
        ) from None
    return train_x, train_y


def validate_test_x(test_x: object, train_x: Tensor, name: str = "test_x") -> Tensor:
    """``test_x`` as ``(*b, M, d)`` on the training data's device with matching ``d``."""
    if isinstance(test_x, Tensor) and test_x.device != train_x.device:
        raise ValueError(
            f"{name} is on {test_x.device} but the model's training data are on "
            f"{train_x.device}; move them to the same device"
        )
    test_x = as_float_tensor(test_x, name, dtype=train_x.dtype, device=train_x.device)
    if test_x.dim() == 1 and train_x.shape[-1] == 1:
        test_x = test_x.unsqueeze(-1)
    if test_x.dim() < 2 or test_x.shape[-1] != train_x.shape[-1]:
        raise ValueError(
            f"{name} must have shape (*batch, M, {train_x.shape[-1]}) to match train_x, "
            f"got {tuple(test_x.shape)}"
        )
    return check_finite(test_x, name)


def unpack_teacher(teacher: ExactGP) -> tuple[Tensor, Tensor, Tensor]:
    """``(train_x, train_y, noise)`` of a trained GPyTorch ``ExactGP`` with a Gaussian likelihood
    (checked by :func:`~gpsd._internal.teacher.validate_teacher`)."""
    train_x, train_y = validate_teacher(
        teacher, GaussianLikelihood, "a gpytorch.likelihoods.GaussianLikelihood (homoskedastic)"
    )
    noise = teacher.likelihood.noise.detach().squeeze(-1)
    return train_x, train_y, noise


#: above this estimate of the relative error (:func:`warn_low_precision_factorisation`) a
#: factorisation in a low-precision dtype warns
LOW_PRECISION_WARNING = 0.1


def warn_low_precision_factorisation(
    kernel: Kernel, x: Tensor, dtype: torch.dtype, gamma_min: float
) -> None:
    r"""Warn with a ``NumericalWarning`` where factoring :math:`\mathbf K + \gamma\mathbf I` in
    ``dtype`` may cost the predictions their accuracy.

    Rounding :math:`\mathbf K` and the solves to the dtype's precision :math:`\epsilon` perturbs
    the solutions by up to about :math:`\epsilon\,\lambda_{\max}/\gamma_{\min}` relative;
    :math:`\lambda_{\max} \le \operatorname{tr}\mathbf K` (a diagonal evaluation) bounds it.
    Variances :math:`k_{**} - \mathbf k_*^\top(\mathbf K + \gamma\mathbf I)^{-1}\mathbf k_*`
    cancel on top of that where the data pin the posterior, so they can be worse than the
    estimate (11 % at an estimate of 0.06: 2000 points, lengthscale 0.2, noise 4e-3), while
    the means are within it.
    Checked where :math:`\epsilon > 10^{-10}` (float32, half precision): float32 data with
    ``linalg_dtype=None``, whose predictions were 15-21 % off at :math:`\gamma = 10^{-6}`,
    :math:`N = 40`, without a word.
    """
    eps = torch.finfo(dtype).eps
    if eps <= 1e-10:
        return
    with torch.no_grad():
        trace = float(to_dense(kernel(x, diag=True)).sum(-1).max())
    estimate = eps * trace / gamma_min
    if estimate > LOW_PRECISION_WARNING:
        warn(
            f"the kernel matrix is factored in {dtype} with a smallest noise of {gamma_min:.3g} "
            f"against a trace of {trace:.3g}: solves may be off by up to about "
            f"{min(estimate, 1.0):.2g} relative (eps * tr K / noise), and the variances, "
            "differences of nearly equal terms where the data pin the posterior, by more; use "
            "linalg_dtype=torch.float64",
            NumericalWarning,
        )


def student_likelihood(noise: Tensor, like: Tensor) -> GaussianLikelihood:
    """A ``GaussianLikelihood`` with the noise variances ``noise`` (shape ``(*b,)``, its batch
    shape), in ``like``'s dtype.

    Its noise constraint is GPyTorch's default lower bound of 1e-4, lowered to half of the
    smallest noise where that is smaller (the students of small or many-step schedules need less).
    """
    noise = noise.detach().to(like)
    bound = min(1e-4, 0.5 * float(noise.min()))
    likelihood = GaussianLikelihood(noise_constraint=GreaterThan(bound), batch_shape=noise.shape)
    likelihood = likelihood.to(like)
    likelihood.noise = noise.unsqueeze(-1)
    return likelihood


def student_batch(
    train_x: Tensor, train_y: Tensor, mean_module: gpytorch.Module, kernel: gpytorch.Module
) -> torch.Size:
    """The broadcast batch shape of the training inputs, targets, prior mean and kernel."""
    with torch.no_grad():
        mean_batch = mean_module(train_x).shape[:-1]
    return torch.broadcast_shapes(
        train_x.shape[:-2], train_y.shape[:-1], mean_batch, getattr(kernel, "batch_shape", ())
    )


def student_gp(
    train_x: Tensor,
    targets: Tensor,
    noise: Tensor,
    mean_module: gpytorch.Module,
    kernel: gpytorch.Module,
) -> ExactGPFromModules:
    """The student ``ExactGP`` (in evaluation mode) of copies of ``mean_module`` and ``kernel``.

    ``targets`` ``(*b, N)`` and ``noise`` ``(*s,)`` may be batched: the student's batch is the
    broadcast of theirs, the inputs', the prior mean's and the kernel's, as the distiller pairs
    them, and its ``GaussianLikelihood`` holds one noise per member.
    """
    mean_module = copy.deepcopy(mean_module)
    kernel = copy.deepcopy(kernel)
    train_x, targets = batched_gp_data(train_x, targets, mean_module)
    batch = torch.broadcast_shapes(targets.shape[:-1], noise.shape, kernel.batch_shape)
    train_x = train_x.expand(*batch, *train_x.shape[-2:])
    targets = targets.expand(*batch, targets.shape[-1])
    likelihood = student_likelihood(noise.expand(batch), train_x)
    return ExactGPFromModules(train_x, targets, likelihood, mean_module, kernel).eval()


def schedule_index(
    noise: Tensor, schedule: object, student_batch: torch.Size | None = None
) -> tuple[int, ...]:
    """``schedule`` checked as an index of one schedule in the batch ``noise.shape[:-1]``.

    For a student (``student_batch`` given: the batch of its data, prior mean and kernel, see
    :func:`student_batch`), ``()`` takes the whole batch, and an index is refused where that
    batch is not empty (a schedule of a batch pairs with it by broadcasting, so one schedule
    alone has no targets, mean or kernel of its own).
    """
    batch = noise.shape[:-1]
    if student_batch is not None and isinstance(schedule, tuple) and not schedule:
        return ()  # a student of the whole batch
    try:  # integer types as check_int takes them (NumPy's, 0-d integer tensors), bool not
        items = schedule if isinstance(schedule, tuple) else (schedule,)
        if any(isinstance(i, bool) for i in items):
            raise TypeError
        schedule = tuple(operator.index(i) for i in items)
    except TypeError:
        raise TypeError(f"schedule must be an int or a tuple of ints, got {schedule!r}") from None
    if not batch:
        if schedule:
            raise ValueError(f"schedule must be () for a single schedule, got {schedule}")
        return ()
    if student_batch:
        raise ValueError(
            "a student of one schedule of a batch of schedules needs unbatched training data, "
            f"kernel and prior mean; got noise of shape {tuple(noise.shape)} and a batch of "
            f"shape {tuple(student_batch)} of these (take the student of the whole batch with "
            "schedule=(), or build a distiller with that schedule alone)"
        )
    if len(schedule) != len(batch) or not all(
        -n <= i < n for i, n in zip(schedule, batch, strict=False)
    ):
        raise ValueError(
            f"schedule must index one schedule of the batch of shape {tuple(batch)} "
            f"(noise has shape {tuple(noise.shape)}), got {schedule or '()'}"
        )
    return schedule


def pair_batches(outer_product: Tensor, outer: torch.Size, inner: torch.Size) -> Tensor:
    """Broadcast two batch shapes that an outer product kept apart.

    ``outer_product`` has shape ``(*outer, *inner, *tail)``; the result has shape
    ``(*broadcast(outer, inner), *tail)``, its entry at a batch index taking the ``outer`` and
    ``inner`` entries that broadcasting pairs (dimensions aligned from the right, size-1
    dimensions repeated).
    """
    tail = outer_product.shape[len(outer) + len(inner) :]
    ndim = max(len(outer), len(inner))
    outer = torch.Size([1] * (ndim - len(outer))) + outer
    inner = torch.Size([1] * (ndim - len(inner))) + inner
    batch = torch.broadcast_shapes(outer, inner)
    padded = outer_product.reshape(*outer, *inner, *tail)
    index = []
    for sizes in (outer, inner):
        for k, size in enumerate(sizes):
            shape = [1] * ndim
            shape[k] = batch[k]
            positions = torch.arange(batch[k], device=outer_product.device)
            index.append((positions if size > 1 else 0 * positions).reshape(shape))
    return padded[tuple(index)]  # shape: (*batch, *tail)


def batched_gp_data(
    train_x: Tensor, train_y: Tensor, mean_module: gpytorch.Module
) -> tuple[Tensor, Tensor]:
    """``train_x`` ``(*b, N, d)`` and ``train_y`` ``(*b, N)`` expanded (views) to one batch.

    ``b`` broadcasts the batches of the inputs, the targets and the prior mean at the inputs: a
    GPyTorch ``ExactGP`` cannot predict from unbatched inputs next to a batch of targets or a
    batched mean (a shape error), so the students and the iterated models get batched inputs.
    A kernel's own batch needs no expansion (GPyTorch broadcasts it).
    """
    with torch.no_grad():
        mean_batch = mean_module(train_x).shape[:-1]
    batch = torch.broadcast_shapes(train_x.shape[:-2], train_y.shape[:-1], mean_batch)
    return train_x.expand(*batch, *train_x.shape[-2:]), train_y.expand(*batch, train_y.shape[-1])


class ExactGPFromModules(ExactGP):
    """An ordinary GPyTorch exact GP assembled from a mean and a kernel module.

    The students of the regression distillers are of this class, so that every GPyTorch tool
    (``ExactMarginalLogLikelihood``, ``get_fantasy_model``, ``state_dict``) applies to them.
    """

    def __init__(self, train_x, train_y, likelihood, mean_module, covar_module) -> None:
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = mean_module
        self.covar_module = covar_module

    def forward(self, x: Tensor) -> MultivariateNormal:
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))
