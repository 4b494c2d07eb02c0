r"""K-class data-centric self-distillation: each step's Newton run started from the prior mean
(``warm_start=False``) or from the previous step's :math:`\mathbf a` (``warm_start=True``, the
default: :math:`\mathbf f = \mathbf m + (\mathbf K + \gamma_t \mathbf I) \mathbf a_{t-1}`),
and a refit from the stored modes (``fit(use_stored_modes=True)``: one full Newton step from
each, then Newton's method).

For each data set (``--datasets``: digits, iris, wine from :func:`gpsd.data.load_dataset`, the
training rows of ``bench_multiclass.py``), a :class:`gpsd.DataCentricGPC` with an RBF kernel
shared by the K latent functions (lengthscale :math:`\sqrt d`, outputscale 5 on the
standardised inputs), ``--steps`` steps, noise 0 at step 1 and ``--noise`` after. Reported per
start: the median wall time of ``fit()`` over ``--repeats`` after one warm-up, the Newton
iterations of each step, and the largest difference of the modes from the cold start's.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_multiclass_warm_start.py \
        --out benchmarks/results/multiclass_warm_start_cpu.md
"""

from __future__ import annotations

import argparse
import functools
import math
import platform

import gpytorch
import torch
from _timing import Report, cpu_name, median_time

import gpsd
from gpsd import DataCentricGPC
from gpsd.data import load_dataset

#: training rows per data set (as in bench_multiclass.py)
N_TRAIN = {"digits": 200, "iris": 75, "wine": 90}


def _model(x: torch.Tensor, labels: torch.Tensor, args: argparse.Namespace, warm: bool):
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = torch.tensor(math.sqrt(x.shape[-1]), dtype=torch.float64)
    kernel.outputscale = torch.tensor(5.0, dtype=torch.float64)
    noise = torch.full((args.steps,), args.noise, dtype=torch.float64)
    noise[0] = 0.0
    return DataCentricGPC(x, labels, kernel, noise=noise, warm_start=warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "iris", "wine"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = Report(args.out)
    report.add(
        "# K-class data-centric distillation: where each step's Newton run starts",
        "",
        f"{cpu_name()}, {torch.get_num_threads()} threads, float64; torch {torch.__version__}, "
        f"gpytorch {gpytorch.__version__}, gpsd {gpsd.__version__}, Python "
        f"{platform.python_version()}. {args.steps} steps, noise 0 then {args.noise:g}; fit() "
        f"time the median of {args.repeats} after a warm-up.",
        "",
        "| data set | n | K | start | fit (s) | vs prior mean | Newton iterations per step "
        "| max mode difference |",
        "|---|---:|---:|---|---:|---:|---|---:|",
    )
    for name in args.datasets:
        data = load_dataset(name, n_train=N_TRAIN[name], seed=0)
        x, labels = data.train_x.double(), data.train_y.long()
        num_classes = int(labels.max()) + 1
        cold = _model(x, labels, args, warm=False)
        warm = _model(x, labels, args, warm=True)
        rows = [
            ("prior mean", cold, False),
            ("previous step's a", warm, False),
            ("stored modes", warm, True),
        ]
        reference, base = None, None
        for start, model, stored in rows:
            seconds = median_time(
                functools.partial(model.fit, use_stored_modes=stored),
                args.repeats,
                torch.device("cpu"),
            )
            modes = model.latent_modes()
            if reference is None:
                reference, base = modes, seconds
            difference = float((modes - reference).abs().max())
            iterations = ", ".join(str(i) for i in model.newton_iterations)
            report.add(
                f"| {name} | {x.shape[0]} | {num_classes} | {start} | {seconds:.3f} "
                f"| {seconds / base:.2f}x | {iterations} | {difference:.1e} |"
            )
    report.add(
        "",
        "Command: `OMP_NUM_THREADS=2 python benchmarks/bench_multiclass_warm_start.py "
        f"--steps {args.steps} --noise {args.noise:g} --repeats {args.repeats}`",
    )
    report.close()


if __name__ == "__main__":
    main()
