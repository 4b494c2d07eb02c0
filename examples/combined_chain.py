"""The combined self-distillation chain on diabetes: test RMSE over the (outer, inner) grid.

Run with no arguments:

    python examples/combined_chain.py

A teacher ExactGP (constant mean, scaled ARD RBF kernel, trained by maximum marginal likelihood)
on the diabetes data set (354 training and 88 test rows), then one ``CombinedGPR`` with the
teacher's noise at every step: 5 outer (distribution-centric) steps, each of 5 inner
(data-centric) steps. Every cell of the grid comes from one factorisation of the kernel matrix.
Prints the test RMSE of every cell (row o = 1 is the data-centric chain, cell (1, 1) the
teacher), the GCV score of every cell, and the cell GCV picks from the training data alone.
``benchmarks/bench_combined_chain.py`` repeats this over 10 splits and three data sets.
"""

from __future__ import annotations

import gpytorch
import torch

from gpsd import CombinedGPR
from gpsd.data import load_dataset

OUTER, INNER = 5, 5


class TeacherGP(gpytorch.models.ExactGP):
    """An ordinary GPyTorch exact GP: constant mean, scaled ARD RBF kernel."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, likelihood) -> None:
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1])
        )

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def train_teacher(x: torch.Tensor, y: torch.Tensor, iterations: int = 150) -> TeacherGP:
    """Maximum marginal likelihood by Adam at learning rate 0.05."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x.dtype)
    teacher = TeacherGP(x, y, likelihood).to(x.dtype)
    teacher.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, teacher)
    optimizer = torch.optim.Adam(teacher.parameters(), lr=0.05)
    for _ in range(iterations):
        optimizer.zero_grad()
        loss = -mll(teacher(x), y)
        loss.backward()
        optimizer.step()
    return teacher.eval()


def grid_table(values: torch.Tensor, digits: int) -> str:
    """A Markdown table of an ``(O, I)`` grid, rows outer steps, columns inner steps."""
    outer, inner = values.shape
    lines = [
        "| o \\ i | " + " | ".join(str(i + 1) for i in range(inner)) + " |",
        "|---:|" + "---:|" * inner,
    ]
    for o in range(outer):
        lines.append(
            f"| {o + 1} | " + " | ".join(f"{float(v):.{digits}f}" for v in values[o]) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    torch.manual_seed(0)
    split = load_dataset("diabetes", seed=0)
    teacher = train_teacher(split.train_x, split.train_y)
    model = CombinedGPR.from_teacher(teacher, outer_steps=OUTER, inner_steps=INNER)
    with torch.no_grad():
        mean = model.predict_mean(split.test_x)  # shape: (O * I, M), row t - 1 for flat step t
        gcv = model.gcv().unflatten(-1, (OUTER, INNER))  # shape: (O, I)
        best = model.best_step("gcv")
    rmse = torch.tensor([split.rmse(m) for m in mean]).unflatten(-1, (OUTER, INNER))
    noise = float(teacher.likelihood.noise.detach())
    print(
        f"diabetes: {split.train_x.shape[0]} training rows, {split.test_x.shape[0]} test rows, "
        f"teacher noise {noise:.4f} (standardised units), {OUTER} outer x {INNER} inner steps"
    )
    print("\nTest RMSE (rows: outer step o, columns: inner step i; (1, 1) is the teacher)\n")
    print(grid_table(rmse, 3))
    print("\nGCV score (training data only; smaller is better)\n")
    print(grid_table(gcv, 4))
    outer, inner = model.grid_step(best)
    print(
        f"\nGCV picks (o, i) = ({outer}, {inner}), flat step {best}: test RMSE "
        f"{float(rmse[outer - 1, inner - 1]):.3f} against the teacher's {float(rmse[0, 0]):.3f} "
        f"and the grid's best {float(rmse.min()):.3f}."
    )


if __name__ == "__main__":
    main()
