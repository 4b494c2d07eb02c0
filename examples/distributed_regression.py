"""Data-centric self-distillation with the kernel rows split across processes (torch.distributed).

Run on two CPU processes (gloo; NCCL, one GPU per process, where CUDA is available):

    torchrun --standalone --nproc_per_node=2 examples/distributed_regression.py

or in one process:

    python examples/distributed_regression.py

Every rank builds the same data and model and calls the same methods: each evaluates its block
of kernel rows and keeps its rows of the Lanczos basis, and every rank ends with the same
predictions, those of one process. Rank 0 prints the time of the fit and of the predictions
(means and variances of every step at the test points), the test RMSE of a few steps, the step
GCV picks, and, with ``--check``, the largest difference from the same model fitted in this
process alone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import gpytorch
import torch
import torch.distributed as dist

import gpsd


def setup() -> tuple[object, torch.device]:
    """The process group and this rank's device: the default group under torchrun (NCCL on
    one GPU per process where CUDA is available, else gloo), or ``None`` in one process."""
    if "RANK" not in os.environ:  # plain python: one process, no group
        return None, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # a failing rank makes the others raise gpsd.DistributedError after this long
    timeout = datetime.timedelta(minutes=5)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    return dist.group.WORLD, device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-size", type=int, default=8000, help="training points N")
    parser.add_argument("--steps", type=int, default=20, help="distillation steps T")
    parser.add_argument("--backend", default="lanczos", choices=["lanczos", "cg"])
    parser.add_argument("--check", action="store_true", help="compare with one process")
    args = parser.parse_args()
    group, device = setup()
    rank = dist.get_rank() if group is not None else 0
    world = dist.get_world_size() if group is not None else 1

    # the same data on every rank: a fixed seed
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(args.train_size, 2, generator=generator, dtype=torch.float64) * 10
    f = torch.sin(x[:, 0]) * torch.cos(0.5 * x[:, 1])
    y = f + 0.3 * torch.randn(args.train_size, generator=generator, dtype=torch.float64)
    test_x = torch.rand(2000, 2, generator=generator, dtype=torch.float64) * 10
    test_f = torch.sin(test_x[:, 0]) * torch.cos(0.5 * test_x[:, 1])
    x, y, test_x, test_f = x.to(device), y.to(device), test_x.to(device), test_f.to(device)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(device, x.dtype)
    kernel.base_kernel.lengthscale = torch.tensor(1.5, dtype=x.dtype)
    noise = torch.full((args.steps,), 0.09, dtype=x.dtype, device=device)

    model = gpsd.DataCentricGPR(
        x, y, kernel, noise=noise, backend=args.backend, process_group=group
    )
    with torch.no_grad():
        start = time.perf_counter()
        model.fit()
        fitted = time.perf_counter()
        prediction = model.predict(test_x)  # (T, 2000) on every rank
        predicted = time.perf_counter()
    rmse = (prediction.mean - test_f).square().mean(-1).sqrt()  # shape: (T,)
    with torch.no_grad():
        best = model.best_step("gcv")  # CG estimates the trace from probe vectors

    if rank == 0:
        print(
            f"{world} process(es), N = {args.train_size}, T = {args.steps}, backend={args.backend}"
        )
        print(f"fit {fitted - start:.2f} s, predictions {predicted - fitted:.2f} s")
        for t in sorted({1, 2, args.steps // 2, args.steps}):
            print(f"step {t:3d}: test RMSE {float(rmse[t - 1]):.4f}")
        print(f"GCV picks step {best}")
    if args.check:
        alone = gpsd.DataCentricGPR(x, y, kernel, noise=noise, backend=args.backend)
        with torch.no_grad():
            reference = alone.predict(test_x)
        mean_diff = float((prediction.mean - reference.mean).abs().max())
        var_diff = float((prediction.variance - reference.variance).abs().max())
        if rank == 0:
            print(f"against one process: means {mean_diff:.2e}, variances {var_diff:.2e}")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
