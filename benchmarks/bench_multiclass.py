"""Self-distillation of K-class GP classifiers on real data: accuracy, log loss and calibration per
step against the teacher, GPyTorch's Dirichlet GP classifier and multinomial logistic regression.

For each data set (``--datasets``: digits, iris, wine from :func:`gpsd.data.load_dataset`) and each
of ``--splits`` random splits (seeds 0, 1, ...), on the standardised inputs:

* **teacher**: the softmax Laplace GPC (:class:`gpsd.laplace.MulticlassLaplacePosterior`) with an
  RBF kernel shared by the K latent functions, its lengthscale and outputscale maximising the
  Laplace marginal likelihood (Adam, ``--teacher-iters`` iterations); it is step 1 of both chains;
* **data-centric**: :class:`gpsd.DataCentricGPC` with ``--steps`` steps, noise 0 at step 1 and
  ``--noise`` after (steps t >= 2 fit the previous step's class probabilities with the continuous
  categorical);
* **tempered**: :class:`gpsd.DistributionCentricGPC` ``method="tempered"``, ``--steps`` steps;
* **Dirichlet GP**: GPyTorch's ``DirichletClassificationLikelihood`` with a batch ``ExactGP`` of K
  outputs (an RBF kernel per class, learnt noise), Adam ``--dirichlet-iters`` iterations, class
  probabilities as the mean softmax of 256 posterior draws (GPyTorch's classification example);
* **logistic regression**: scikit-learn's multinomial ``LogisticRegression`` (C = 1).

The rows not used for training are split in two: a third for validation (the step each chain
would pick by its validation log loss, ``best_step("validation")``) and two thirds for testing.
Metrics on the test rows: accuracy, mean log loss (NLL) and the expected calibration error (ECE,
15 equal-width bins of the top-class probability). Tables give the mean and the standard error
over the splits.

Usage::

    python benchmarks/bench_multiclass.py --out benchmarks/results/multiclass_cpu.md
    python benchmarks/bench_multiclass.py --datasets iris --splits 2 --steps 3   # a smoke run
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import gpytorch
import numpy as np
import torch
from _timing import cpu_name, load_line

import gpsd
from gpsd import DataCentricGPC, DistributionCentricGPC
from gpsd.data import load_dataset
from gpsd.laplace import MulticlassLaplacePosterior

#: training rows per data set (the rest are split into validation and test rows)
N_TRAIN = {"digits": 200, "iris": 75, "wine": 90}
#: rows outside training per data set (digits keeps 600 of its remaining 1597)
N_REST = {"digits": 600, "iris": 75, "wine": 88}


def fitted_kernel(x: torch.Tensor, y: torch.Tensor, num_classes: int, iters: int):
    """The teacher's shared RBF kernel, by the softmax Laplace marginal likelihood."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = torch.tensor(math.sqrt(x.shape[-1]), dtype=torch.float64)
    kernel.outputscale = torch.tensor(5.0, dtype=torch.float64)
    optimizer = torch.optim.Adam(kernel.parameters(), lr=0.1)
    for _ in range(iters):
        optimizer.zero_grad()
        posterior = MulticlassLaplacePosterior(
            0.0, kernel(x).to_dense(), "softmax", y, num_classes=num_classes
        )
        (-posterior.log_marginal_likelihood() / len(y)).backward()
        optimizer.step()
    for parameter in kernel.parameters():
        parameter.requires_grad_(False)
    return kernel


def metrics(proba: torch.Tensor, y: torch.Tensor, bins: int = 15) -> tuple[float, float, float]:
    """Accuracy, mean log loss and expected calibration error of ``proba`` ``(M, K)``."""
    proba = proba.double()
    confidence, predicted = proba.max(-1)
    correct = (predicted == y).double()
    nll = -proba.gather(-1, y.unsqueeze(-1)).squeeze(-1).clamp_min(1e-300).log().mean()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inside = (confidence > lo) & (confidence <= hi)
        if inside.any():
            share = inside.double().mean()
            ece += float(share * (correct[inside].mean() - confidence[inside].mean()).abs())
    return float(correct.mean()), float(nll), ece


class DirichletGP(gpytorch.models.ExactGP):
    """GPyTorch's Dirichlet GP classifier: a batch ExactGP of one output per class."""

    def __init__(self, x, targets, likelihood, num_classes):
        super().__init__(x, targets, likelihood)
        batch = torch.Size((num_classes,))
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def dirichlet_proba(x, y, test_x, num_classes: int, iters: int) -> torch.Tensor:
    likelihood = gpytorch.likelihoods.DirichletClassificationLikelihood(
        y, learn_additional_noise=True, dtype=torch.float64
    )
    model = DirichletGP(x, likelihood.transformed_targets, likelihood, num_classes).double()
    model.train(), likelihood.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    for _ in range(iters):
        optimizer.zero_grad()
        loss = -mll(model(x), likelihood.transformed_targets).sum()
        loss.backward()
        optimizer.step()
    model.eval(), likelihood.eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), gpytorch.settings.fast_pred_var():
        latent = model(test_x)  # batch (K,) of (M,)
        mean, std = latent.mean, latent.variance.clamp_min(0).sqrt()
        draws = mean + std * torch.randn(256, *mean.shape, generator=gen, dtype=mean.dtype)
        return draws.softmax(-2).mean(0).T  # (M, K)


def logistic_proba(x, y, test_x) -> torch.Tensor:
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=1.0, max_iter=5000).fit(x.numpy(), y.numpy())
    return torch.from_numpy(model.predict_proba(test_x.numpy()))


def one_split(name: str, seed: int, args) -> dict:
    data = load_dataset(name, n_train=N_TRAIN[name], n_test=N_REST[name], seed=seed)
    x, y = data.train_x, data.train_y
    num_classes = int(torch.cat([y, data.test_y]).max()) + 1
    rest = data.test_y.shape[0]
    val = slice(0, rest // 3)
    test = slice(rest // 3, rest)
    val_x, val_y = data.test_x[val], data.test_y[val]
    test_x, test_y = data.test_x[test], data.test_y[test]
    out: dict[str, tuple] = {}
    start = time.perf_counter()
    kernel = fitted_kernel(x, y, num_classes, args.teacher_iters)
    schedule = [0.0] + [args.noise] * (args.steps - 1)
    chains = {
        "data-centric": DataCentricGPC(x, y, kernel, num_steps=args.steps, noise=schedule),
        "tempered": DistributionCentricGPC(x, y, kernel, num_steps=args.steps, method="tempered"),
    }
    for label, chain in chains.items():
        with torch.no_grad():
            proba = chain.predict_proba(test_x)  # (T, M, K)
            chosen = chain.best_step("validation", val_x=val_x, val_y=val_y)
        out["teacher (step 1)"] = metrics(proba[0], test_y)
        for t in range(1, args.steps):
            out[f"{label} step {t + 1}"] = metrics(proba[t], test_y)
        out[f"{label}, step by validation"] = metrics(proba[chosen - 1], test_y)
        out[f"{label} chosen step"] = (float(chosen),)
    out["Dirichlet GP (GPyTorch)"] = metrics(
        dirichlet_proba(x, y, test_x, num_classes, args.dirichlet_iters), test_y
    )
    out["logistic regression"] = metrics(logistic_proba(x, y, test_x), test_y)
    out["seconds"] = (time.perf_counter() - start,)
    return out


def summary(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {statistics.stdev(values) / math.sqrt(len(values)):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "iris", "wine"])
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--teacher-iters", type=int, default=40)
    parser.add_argument("--dirichlet-iters", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    lines = [
        "# Self-distilled K-class GP classifiers on real data",
        "",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} torch threads; device: cpu; "
        "dtype: float64",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, gpsd {gpsd.__version__}, "
        f"numpy {np.__version__}, Python {platform.python_version()}",
        f"- {args.splits} random splits per data set; {args.steps} steps, data-centric noise "
        f"0 then {args.noise}; teacher kernel by {args.teacher_iters} Adam iterations of the "
        f"softmax Laplace evidence; Dirichlet GP {args.dirichlet_iters} Adam iterations",
        f"- command: `python benchmarks/bench_multiclass.py --splits {args.splits} --steps "
        f"{args.steps} --datasets {' '.join(args.datasets)}`",
        "",
    ]
    for name in args.datasets:
        runs = [one_split(name, seed, args) for seed in range(args.splits)]
        rows = [k for k in runs[0] if k not in ("seconds",) and not k.endswith("chosen step")]
        lines += [
            f"## {name}: {N_TRAIN[name]} training rows, "
            f"{N_REST[name] // 3} validation, {N_REST[name] - N_REST[name] // 3} test",
            "",
            "| model | accuracy | log loss | ECE |",
            "|---|---:|---:|---:|",
        ]
        for row in rows:
            cells = [summary([run[row][i] for run in runs]) for i in range(3)]
            lines.append(f"| {row} | {' | '.join(cells)} |")
        for label in ("data-centric", "tempered"):
            picked = [int(run[f"{label} chosen step"][0]) for run in runs]
            lines.append("")
            lines.append(f"{label}: validation chose steps {picked}.")
        lines.append(
            f"Seconds per split (all models): {summary([run['seconds'][0] for run in runs])}."
        )
        lines.append("")
        print("\n".join(lines[-(len(rows) + 9) :]), flush=True)
    lines.append(load_line())
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report)


if __name__ == "__main__":
    main()
