"""The posterior covariance of a trained exact GP, as a GPyTorch kernel."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from gpytorch.models import ExactGP
from linear_operator import to_dense
from torch import Tensor

from gpsd._internal.distances import same_inputs
from gpsd._internal.teacher import check_inputs, set_mode_keeping_copies, teacher_posterior

__all__ = ["PosteriorKernel"]


class PosteriorKernel(Kernel):
    r"""The posterior covariance :math:`k_*` of a trained teacher GP, usable as a prior kernel.

    .. math::
        k_*(x, x') = k(x, x') - k(x, \mathbf X)\,(\mathbf K_{XX} + \boldsymbol\Sigma)^{-1}
        k(\mathbf X, x')
        = k(x, x') - \mathbf a(x)^\top \mathbf a(x'), \quad
        \mathbf a(x) = \mathbf L^{-1} k(\mathbf X, x),

    with :math:`\mathbf L\mathbf L^\top = \mathbf K_{XX} + \boldsymbol\Sigma` factored once and
    stored as a buffer (Borup & Andersen, §3.2). A student ``ExactGP`` with
    ``PosteriorMean(teacher)`` and ``PosteriorKernel(teacher)`` (plus, optionally, a kernel of its
    own: ``PosteriorKernel(teacher) + ScaleKernel(RBFKernel())``) is the teacher's posterior used
    as a prior; conditioning it on new data equals ``teacher.get_fantasy_model``. Chains of
    posterior kernels (distribution-centric distillation, eq. 7) evaluate a prior that is itself
    a ``PosteriorKernel`` once on the stacked inputs (the test points and each level's training
    inputs, so level :math:`t` of a chain sees :math:`M + tN` rows): the cost grows polynomially
    with the chain's length, where evaluating each block separately would double it per level.

    The teacher's kernel is a copy whose parameters are buffers (``parameters()`` of a student
    holding this kernel lists the student's own parameters only), kept in evaluation mode
    whatever mode this kernel is put in (an ``InducingPointKernel`` or a ``GridKernel`` evaluates
    differently in training mode, and the student of a training loop is in training mode).

    :param teacher: a trained ``gpytorch.models.ExactGP`` with a Gaussian likelihood (checked:
        a ``TypeError`` or ``ValueError`` names what is missing), whose
        ``forward`` applies its ``mean_module`` and ``covar_module`` to the inputs as they come
        (the GPyTorch convention; a ``forward`` that transforms them first is not reproduced).
    """

    is_stationary = False

    def __init__(self, teacher: ExactGP, **kwargs) -> None:
        super().__init__(**kwargs)
        post = teacher_posterior(teacher)
        self.prior_covar = post["covar_module"]
        self.register_buffer("train_inputs", post["train_inputs"])
        self.register_buffer("cholesky", post["cholesky"])

    @property
    def batch_shape(self) -> torch.Size:
        """The batch shape of this kernel and the teacher's kernel, read through one level.

        GPyTorch's default asks every kernel below for its own (which asks every kernel below it
        again): exponential in the length of a chain of posterior kernels.
        """
        return torch.broadcast_shapes(self._batch_shape, self.prior_covar.batch_shape)

    @batch_shape.setter
    def batch_shape(self, value: torch.Size) -> None:
        self._batch_shape = value

    def train(self, mode: bool = True) -> PosteriorKernel:
        """Set the mode of this kernel; the teacher's frozen kernel stays in evaluation mode."""
        return set_mode_keeping_copies(self, mode)

    def _prior_blocks(self, x1: Tensor, x2: Tensor | None, diag: bool):
        """``k(x1, x2)`` (or its diagonal), ``k(X, x1)`` and ``k(X, x2)`` of the teacher's prior."""
        # A batched teacher serves unbatched inputs and vice versa: broadcast every batch shape.
        shapes = [x.shape[:-2] for x in (x1, x2, self.train_inputs) if x is not None]
        batch = torch.broadcast_shapes(*shapes)
        train = self.train_inputs.expand(*batch, *self.train_inputs.shape[-2:])
        x1 = x1.expand(*batch, *x1.shape[-2:])
        x2 = None if x2 is None else x2.expand(*batch, *x2.shape[-2:])
        if isinstance(self.prior_covar, PosteriorKernel):
            # One joint evaluation keeps nested posterior kernels linear in the chain's length.
            parts = [x1] if x2 is None else [x1, x2]
            joint = to_dense(self.prior_covar(torch.cat([*parts, train], dim=-2)))
            m1 = x1.shape[-2]
            m2 = m1 if x2 is None else x2.shape[-2]
            off = m1 if x2 is None else m1 + m2
            k12 = joint[..., :m1, (0 if x2 is None else m1) : (0 if x2 is None else m1) + m2]
            k_x1 = joint[..., off:, :m1]
            k_x2 = k_x1 if x2 is None else joint[..., off:, m1 : m1 + m2]
            return (k12.diagonal(dim1=-2, dim2=-1) if diag else k12), k_x1, k_x2
        k12 = self.prior_covar(x1, x1 if x2 is None else x2, diag=diag)
        k_x1 = to_dense(self.prior_covar(train, x1))
        k_x2 = k_x1 if x2 is None else to_dense(self.prior_covar(train, x2))
        return to_dense(k12), k_x1, k_x2

    def forward(
        self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params
    ) -> Tensor:
        if last_dim_is_batch:
            raise ValueError("PosteriorKernel does not support last_dim_is_batch=True")
        same = same_inputs(x1, x2)  # one solve serves both
        x1 = check_inputs(x1, self.train_inputs, "x1")
        x2 = check_inputs(x2, self.train_inputs, "x2")
        k12, k_x1, k_x2 = self._prior_blocks(x1, None if same else x2, diag)
        a1 = torch.linalg.solve_triangular(self.cholesky, k_x1, upper=False)  # shape: (*b, N, M1)
        a2 = a1 if same else torch.linalg.solve_triangular(self.cholesky, k_x2, upper=False)
        if diag:
            return k12 - (a1 * a2).sum(-2)
        return k12 - a1.mT @ a2
