"""The one check of a teacher: every model built from one refuses the same fault with the same
exception, a :class:`~gpsd.TeacherError` naming the attribute of ``teacher`` at fault."""

import gpytorch
import pytest
import torch

from gpsd import (
    CombinedGPR,
    DataCentricGPR,
    GpsdError,
    KernelDistillation,
    PosteriorKernel,
    PosteriorMean,
    TeacherError,
)

DT = torch.float64


class _ExactGP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.RBFKernel().to(DT)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


BUILDERS = {
    "DataCentricGPR.from_teacher": lambda t: DataCentricGPR.from_teacher(t, num_steps=2),
    "CombinedGPR.from_teacher": lambda t: CombinedGPR.from_teacher(t, inner_steps=1, outer_steps=2),
    "KernelDistillation": lambda t: KernelDistillation(t, num_inducing=4, sparsity=2),
    "PosteriorMean": PosteriorMean,
    "PosteriorKernel": PosteriorKernel,
}


def _faulty_teachers():
    x = torch.linspace(0, 1, 10, dtype=DT).unsqueeze(-1)
    y = torch.sin(3 * x.squeeze(-1))
    gaussian = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    bernoulli = _ExactGP(x, y, gaussian)
    bernoulli.likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    without_kernel = _ExactGP(x, y, gaussian)
    del without_kernel.covar_module
    nonfinite = _ExactGP(x, y.clone(), gaussian)
    nonfinite.train_targets[0] = float("nan")
    return {
        "not an ExactGP": (gpytorch.kernels.RBFKernel(), "teacher must be a gpytorch"),
        "another likelihood": (bernoulli, "teacher.likelihood must be"),
        "no training data": (_ExactGP(None, None, gaussian), "teacher has no training data"),
        "no covar_module": (without_kernel, "teacher.covar_module must be"),
        "NaN targets": (nonfinite, "teacher.train_targets must be finite"),
    }


@pytest.mark.parametrize("fault", list(_faulty_teachers()))
@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_every_model_built_from_a_teacher_refuses_a_fault_with_one_exception(build, fault):
    teacher, message = _faulty_teachers()[fault]
    with pytest.raises(TeacherError, match=message) as caught:
        build(teacher)
    # the one class is gpsd's, and the built-in exceptions a caller of a bad argument catches
    assert all(isinstance(caught.value, c) for c in (GpsdError, TypeError, ValueError))


def test_kernel_distillation_refuses_a_batched_or_untrained_teacher_by_the_same_exception():
    x = torch.linspace(0, 1, 10, dtype=DT).unsqueeze(-1)
    y = torch.sin(3 * x.squeeze(-1))
    batched = _ExactGP(
        x.expand(2, 10, 1), y.expand(2, 10), gpytorch.likelihoods.GaussianLikelihood()
    )
    with pytest.raises(TeacherError, match="must have no batch shape"):
        KernelDistillation(batched, num_inducing=4, sparsity=2)
    untrained = _ExactGP(x, y, gpytorch.likelihoods.GaussianLikelihood().to(DT))
    with pytest.raises(TeacherError, match="untrained"):
        KernelDistillation(untrained, num_inducing=4, sparsity=2)
