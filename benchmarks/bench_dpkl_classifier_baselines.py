"""The DPKL classifier against logistic regression and a Laplace GP classifier on small labelled sets.

Binary tasks: ``digits`` (scikit-learn's 8x8 digits, label 1 for the digits 5-9, 64 pixels),
``breast_cancer`` (30 features) and ``spam`` (DAAG's spam7, 6 features), loaded and standardised
by :func:`gpsd.data.load_dataset`; ``n`` labelled training points drawn at random per seed, a
held-out test set of ``--n-test`` rows (fewer for breast cancer, which has 569). Methods:

* ``logistic regression``: scikit-learn's ``LogisticRegression()`` (L2, C = 1, lbfgs);
* ``GPC (ARD RBF)``: :class:`gpsd.LaplaceGPClassifier` with ``ScaleKernel(RBF, ARD)``, output
  scale 1 and lengthscales sqrt(D) at the start, hyperparameters fitted by
  ``optimize_hyperparameters(max_iter=100, lr=0.05)``;
* ``DPKL default``: ``DPKLClassifier(x, y, net)`` with every other default (10 embedding
  particles, 10 class-weight particles, the paper's functional gradient) and ``fit()`` with its
  defaults (100 epochs, batch 32, lr 1e-3, no validation); ``net`` is the paper's MNIST network
  (one hidden layer of 64 tanh units) onto a 2-dimensional embedding;
* ``DPKL paper``: as the paper's MNIST protocol (Appendix C.3): the same network and particles,
  100 epochs, 10 % of the labelled points held out, the best validation accuracy (checked every
  10 epochs) restored;
* ``--variants``: the DPKL settings of :data:`VARIANTS` (16 latent dimensions);
* ``--diagnose``: the training and test accuracy and NLL of the DPKL settings of
  :data:`DIAGNOSE` (learning rate, epochs, weight decay, a linear embedding, raw inputs beside the
  embedding, the latent width) on one data set and ``n``.

Accuracy and log loss (mean NLL of the true label, probabilities clipped at 1e-12) on the test
set, mean ± standard error over ``--seeds`` seeds, and the median fit time.

Usage::

    python benchmarks/bench_dpkl_classifier_baselines.py --datasets breast_cancer \\
        --ns 50 100 300 --seeds 10 --out benchmarks/results/dpkl_classifier_baselines.md
"""

from __future__ import annotations

import argparse
import functools
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable

import gpytorch
import numpy as np
import torch
from _timing import Report, cpu_name
from torch import nn

from gpsd import DPKLClassifier, LaplaceGPClassifier
from gpsd.data.real import load_dataset

N_TEST = {"digits": 1000, "breast_cancer": 250, "spam": 1000}


def binary_split(name: str, n: int, n_test: int, seed: int):
    data = load_dataset(name, n_train=n, n_test=min(n_test, N_TEST[name]), seed=seed)
    tr_y, te_y = data.train_y, data.test_y
    if name == "digits":  # 0-4 against 5-9
        tr_y, te_y = (tr_y >= 5), (te_y >= 5)
    return data.train_x, tr_y.long(), data.test_x, te_y.long()


def scores(proba: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Accuracy and mean log loss of ``proba`` ``(M, 2)`` on labels ``y``."""
    p = np.clip(proba[np.arange(len(y)), y], 1e-12, 1.0)
    return float((proba.argmax(1) == y).mean()), float(-np.log(p).mean())


def logistic_regression(x, y, tx, seed):
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(max_iter=5000).fit(x.numpy(), y.numpy())
    return model.predict_proba(tx.numpy())


def gp_classifier(x, y, tx, seed):
    d = x.shape[-1]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d)).double()
    kernel.base_kernel.lengthscale = math.sqrt(d)
    model = LaplaceGPClassifier(x.double(), y.double(), kernel)
    model.optimize_hyperparameters(max_iter=100, lr=0.05)
    with torch.no_grad():
        return model.predict_proba(tx.double()).numpy()


def net(d_in: int, latent: int, hidden: int = 64) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, latent))


def validation_split(n: int, seed: int, fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(1000 + seed).permutation(n)
    n_val = max(5, int(round(fraction * n)))
    return perm[n_val:], perm[:n_val]


def dpkl(latent: int = 2, validation: bool = False, **fit) -> Callable:
    def run(x, y, tx, seed):
        torch.manual_seed(seed)
        x, tx = x.float(), tx.float()
        tr, val = validation_split(len(y), seed) if validation else (np.arange(len(y)), None)
        model = DPKLClassifier(
            x[tr], y[tr], net(x.shape[-1], latent), num_classes=2, latent_dim=latent
        )
        options = dict(fit)
        if validation:
            options.update(val_x=x[val], val_y=y[val])
        model.fit(**options)
        return model.predict_proba(tx).double().numpy()

    return run


METHODS: dict[str, Callable] = {
    "logistic regression": logistic_regression,
    "GPC (ARD RBF)": gp_classifier,
    "DPKL default": dpkl(),
    "DPKL paper": dpkl(validation=True),
}

#: further DPKL settings, chosen with ``--variants``: the same, with 16 latent dimensions
VARIANTS: dict[str, Callable] = {
    "DPKL latent 16": dpkl(latent=16),
    "DPKL latent 16 + validation": dpkl(latent=16, validation=True),
}


class SkipNet(nn.Module):
    """The paper's network next to the raw inputs: ``[net(x), x]`` (``latent + D`` outputs)."""

    def __init__(self, d_in: int, latent: int) -> None:
        super().__init__()
        self.net = net(d_in, latent)()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.net(x), x], -1)


#: the ``--diagnose`` settings: (network factory of D, latent width of D, fit options, Adam's
#: weight decay). Weight decay goes through ``torch.optim.Adam``'s ``weight_decay`` on every
#: parameter (the classifier has no option for it), patched in for the fit.
DIAGNOSE = {
    "default (latent 2, lr 1e-3, 100 epochs)": (lambda d: net(d, 2), lambda d: 2, {}, 0.0),
    "latent 2, lr 1e-2": (lambda d: net(d, 2), lambda d: 2, {"lr": 1e-2}, 0.0),
    "latent 2, lr 1e-2, 300 epochs": (
        lambda d: net(d, 2),
        lambda d: 2,
        {"lr": 1e-2, "max_iter": 300},
        0.0,
    ),
    "latent 2, 30 epochs": (lambda d: net(d, 2), lambda d: 2, {"max_iter": 30}, 0.0),
    "latent 2, weight decay 1e-2": (lambda d: net(d, 2), lambda d: 2, {}, 1e-2),
    "latent 2, weight decay 1e-1": (lambda d: net(d, 2), lambda d: 2, {}, 1e-1),
    "linear D -> 2": (lambda d: lambda: nn.Linear(d, 2), lambda d: 2, {}, 0.0),
    "[net(x), x] (raw inputs beside)": (
        lambda d: lambda: SkipNet(d, 2),
        lambda d: 2 + d,
        {},
        0.0,
    ),
    "latent 16": (lambda d: net(d, 16), lambda d: 16, {}, 0.0),
    "latent 16, lr 1e-2": (lambda d: net(d, 16), lambda d: 16, {"lr": 1e-2}, 0.0),
    "latent 16, lr 1e-2, weight decay 1e-2": (
        lambda d: net(d, 16),
        lambda d: 16,
        {"lr": 1e-2},
        1e-2,
    ),
}


def diagnose(report: Report, name: str, n: int, seeds: int, n_test: int) -> None:
    """Training and test accuracy and NLL of the :data:`DIAGNOSE` settings (mean over seeds)."""
    report.add(
        f"## Diagnosis: {name}, n = {n}, {seeds} seeds (mean ± s.e.)\n",
        "| DPKL setting | train accuracy | train NLL | test accuracy | test NLL | fit time (s) |",
        "|---|---|---|---|---|---|",
    )
    adam = torch.optim.Adam
    for setting, (make, width, options, decay) in DIAGNOSE.items():
        rows = []
        for seed in range(seeds):
            x, y, tx, ty = binary_split(name, n, n_test, seed)
            x, tx = x.float(), tx.float()
            d = x.shape[-1]
            torch.manual_seed(seed)
            model = DPKLClassifier(x, y, make(d), num_classes=2, latent_dim=width(d))
            torch.optim.Adam = functools.partial(adam, weight_decay=decay)
            try:
                start = time.perf_counter()
                model.fit(**options)
                seconds = time.perf_counter() - start
            finally:
                torch.optim.Adam = adam
            rows.append(
                (model.accuracy(x, y), model.nll(x, y), model.accuracy(tx, ty), model.nll(tx, ty))
                + (seconds,)
            )
        cols = list(zip(*rows, strict=True))
        report.add(
            f"| {setting} | "
            + " | ".join(mean_se(list(c)) for c in cols[:4])
            + f" | {np.median(cols[4]):.2f} |"
        )
    report.add("")


def mean_se(values: list[float]) -> str:
    a = np.asarray(values)
    se = a.std(ddof=1) / math.sqrt(len(a)) if len(a) > 1 else float("nan")
    return f"{a.mean():.3f} ± {se:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "breast_cancer", "spam"])
    parser.add_argument("--ns", type=int, nargs="+", default=[50, 100, 300])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--n-test", type=int, default=1000)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--variants", nargs="*", default=[], help=f"from {list(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="train/test metrics of the DIAGNOSE settings on the first dataset and n instead",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    methods = {k: METHODS[k] for k in args.methods} | {k: VARIANTS[k] for k in args.variants}
    report = Report(args.out)
    report.add(
        "# DPKL classifier against logistic regression and a Laplace GP classifier\n",
        f"- machine: 2-core x86_64 CPU shared with other jobs (busy), {cpu_name()}, "
        f"{torch.get_num_threads()} torch thread(s), {platform.system()} {platform.release()}",
        "- device: cpu; dtype: float32 for DPKL, float64 for the GP classifier and scikit-learn",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, "
        f"python {platform.python_version()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- {args.seeds} seeds (training set, test set, network initialisation); test sets of "
        f"{args.n_test} rows (breast cancer: 250); mean ± standard error; fit time: median\n",
    )
    if args.diagnose:
        diagnose(report, args.datasets[0], args.ns[0], args.seeds, args.n_test)
        report.close()
        return
    for name in args.datasets:
        report.add(
            f"## {name}\n",
            "| n | method | test accuracy | test log loss | fit time (s) |",
            "|---|---|---|---|---|",
        )
        for n in args.ns:
            rows = {m: ([], [], []) for m in methods}
            for seed in range(args.seeds):
                x, y, tx, ty = binary_split(name, n, args.n_test, seed)
                for method, run in methods.items():
                    start = time.perf_counter()
                    proba = run(x, y, tx, seed)
                    seconds = time.perf_counter() - start
                    acc, loss = scores(proba, ty.numpy())
                    for store, value in zip(rows[method], (acc, loss, seconds), strict=True):
                        store.append(value)
            for method, (acc, loss, seconds) in rows.items():
                report.add(
                    f"| {n} | {method} | {mean_se(acc)} | {mean_se(loss)} "
                    f"| {np.median(seconds):.2f} |"
                )
        report.add("")
    report.close()


if __name__ == "__main__":
    main()
