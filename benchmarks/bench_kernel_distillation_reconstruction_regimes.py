"""Regime map of Appendix B (Fig. 2) of Song & Sun: kernel reconstruction, distillation vs SoR.

1000 sorted inputs from N(0, 25), an RBF kernel (the paper gives no lengthscale), SoR with 200
K-means inducing points, distillation with m = 100 and b = 6. The sweep covers the lengthscale,
the jitter SoR adds to K_UU (relative to its mean diagonal; 0 is an SVD least-squares solve,
the exact Nyström matrix) and the descent (T block least-squares or projected-gradient steps
after the least-squares start). It prints ‖K_XX − K̃‖_F, absolute and relative to ‖K_XX‖_F.

Run: ``python benchmarks/bench_kernel_distillation_reconstruction_regimes.py [--out PATH]``
"""

from __future__ import annotations

import argparse
import sys
import time

import gpytorch
import torch
from _timing import cpu_name, load_line

from gpsd.data import kernel_reconstruction_inputs
from gpsd.kernel_distillation import KernelDistillation, kmeans

DT = torch.float64


def rbf(lengthscale: float) -> gpytorch.kernels.Kernel:
    k = gpytorch.kernels.RBFKernel().to(DT)
    k.lengthscale = lengthscale
    return k


def sor_error(kernel, x, k_xx, u, jitter: float) -> float:
    with torch.no_grad():
        k_xu = kernel(x, u).to_dense()
        k_uu = kernel(u, u).to_dense()
    if jitter == 0.0:
        sol = torch.linalg.lstsq(k_uu, k_xu.T, driver="gelsd").solution
    else:
        eye = torch.eye(u.shape[0], dtype=DT)
        sol = torch.linalg.solve(k_uu + jitter * k_uu.diagonal().mean() * eye, k_xu.T)
    return float((k_xx - k_xu @ sol).norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--lengthscales", type=float, nargs="+",
                        default=[0.25, 0.5, 1.0, 2.0, 4.0, 8.0])  # fmt: skip
    parser.add_argument("--jitters", type=float, nargs="+", default=[0.0, 1e-8, 1e-6, 1e-4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = []

    def out(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    out("# Appendix B (Fig. 2) regime map: kernel reconstruction, distillation vs SoR\n")
    out(f"- machine: {cpu_name()}, 2-core CPU shared with other jobs (busy), 1 torch thread; "
        "device: cpu; dtype: float64")  # fmt: skip
    out(f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}")
    out(f"- command: `OMP_NUM_THREADS=1 python {' '.join(sys.argv)}`")
    out(f"- n = {args.n} sorted inputs from N(0, 25) (seed {args.seed}); RBF, outputscale 1; SoR "
        "m = 200 K-means points, K_XU (K_UU + jitter mean(diag K_UU) I)^-1 K_UX (jitter 0: SVD "
        f"least squares); distillation m = 100, b = 6, T = {args.steps} steps of each descent")  # fmt: skip
    out("- paper (lengthscale not given): SoR 8.17e-6, distillation 2.39e-7 (absolute "
        "Frobenius norm)\n")  # fmt: skip
    x = kernel_reconstruction_inputs(args.n, seed=args.seed)
    y = torch.zeros(args.n, dtype=DT)
    head = " | ".join(f"SoR jitter {j:g}" for j in args.jitters)
    out(f"| lengthscale | ‖K‖_F | {head} | distil. init | distil. T block | distil. T gradient "
        "| best distil. / best SoR |")  # fmt: skip
    out("|---:|---:|" + "---:|" * (len(args.jitters) + 4))
    rel_rows = []
    for ell in args.lengthscales:
        t0 = time.perf_counter()
        kernel = rbf(ell)
        with torch.no_grad():
            k_xx = kernel(x, x).to_dense()
        norm = float(k_xx.norm())
        u_sor = kmeans(x, 200, seed=args.seed)
        sor = [sor_error(kernel, x, k_xx, u_sor, j) for j in args.jitters]
        res = {}
        for descent in ("block", "gradient"):
            kd = KernelDistillation.from_data(
                x, y, kernel, noise=1e-2, num_inducing=100, sparsity=6, max_iter=args.steps,
                seed=args.seed, descent=descent,
            ).fit()  # fmt: skip
            res[descent] = kd.frobenius_errors
        init, blk, grd = res["block"][0], res["block"][-1], res["gradient"][-1]
        ratio = min(init, blk, grd) / min(sor)
        out(f"| {ell:g} | {norm:.3e} | " + " | ".join(f"{e:.2e}" for e in sor)
            + f" | {init:.2e} | {blk:.2e} | {grd:.2e} | {ratio:.2g} |")  # fmt: skip
        rel_rows.append((ell, [e / norm for e in sor], init / norm, blk / norm, grd / norm))
        print(f"  ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    out("\nRelative errors ‖K_XX − K̃‖_F / ‖K_XX‖_F:\n")
    out(f"| lengthscale | {head} | distil. init | distil. T block | distil. T gradient |")
    out("|---:|" + "---:|" * (len(args.jitters) + 3))
    for ell, sor, init, blk, grd in rel_rows:
        out(f"| {ell:g} | " + " | ".join(f"{e:.2e}" for e in sor)
            + f" | {init:.2e} | {blk:.2e} | {grd:.2e} |")  # fmt: skip
    lines.insert(0, load_line() + "\n")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
