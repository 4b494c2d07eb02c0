"""The posterior mean of a trained exact GP, as a GPyTorch prior mean."""

from __future__ import annotations

from gpytorch.means import Mean
from gpytorch.models import ExactGP
from torch import Tensor

from gpsd._internal.teacher import check_inputs, set_mode_keeping_copies, teacher_posterior

__all__ = ["PosteriorMean"]


class PosteriorMean(Mean):
    r"""The posterior mean :math:`m_*` of a trained teacher GP, usable as a student's prior mean.

    For a teacher with prior :math:`\mathcal{GP}(m, k)`, training data :math:`(\mathbf X,\mathbf y)`
    and Gaussian noise :math:`\boldsymbol\Sigma` (Borup & Andersen, §3.2):

    .. math::
        m_*(x) = m(x) + k(x, \mathbf X)\,(\mathbf K_{XX} + \boldsymbol\Sigma)^{-1}
        (\mathbf y - m(\mathbf X)).

    The weights :math:`(\mathbf K_{XX} + \boldsymbol\Sigma)^{-1}(\mathbf y - m(\mathbf X))` are
    computed once and stored as a buffer, next to copies of the teacher's mean and kernel whose
    parameters are buffers too, so the student's ``train()``/``eval()`` never touches the
    teacher, later changes to the teacher do not leak in, and ``parameters()`` of a student
    holding this module lists the student's own parameters only. The copies stay in evaluation
    mode whatever mode this module is put in (an ``InducingPointKernel`` evaluates differently in
    training mode).

    :param teacher: a trained ``gpytorch.models.ExactGP`` with a Gaussian likelihood (checked:
        a ``TypeError`` or ``ValueError`` names what is missing), defining
        ``mean_module`` and ``covar_module`` and applying them to the inputs as they come (the
        GPyTorch convention; a ``forward`` that transforms them first is not reproduced).
    """

    def __init__(self, teacher: ExactGP) -> None:
        super().__init__()
        post = teacher_posterior(teacher)
        self.prior_mean = post["mean_module"]
        self.prior_covar = post["covar_module"]
        self.register_buffer("train_inputs", post["train_inputs"])
        self.register_buffer("weights", post["weights"])

    def train(self, mode: bool = True) -> PosteriorMean:
        """Set the mode of this module; the teacher's frozen copies stay in evaluation mode."""
        return set_mode_keeping_copies(self, mode)

    def forward(self, x: Tensor) -> Tensor:
        x = check_inputs(x, self.train_inputs)
        cross = self.prior_covar(x, self.train_inputs)  # shape: (*b, M, N)
        return self.prior_mean(x) + (cross @ self.weights.unsqueeze(-1)).squeeze(-1)
