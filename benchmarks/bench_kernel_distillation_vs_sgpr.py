"""Kernel distillation against trained SGPR, SoR and KISS-GP at equal m (gpsd issue 32, item 2).

For Boston (455/51), concrete (824/206) and a 5,000-row subset of deliveries (1,000 test rows),
with one exact GP (ARD RBF, hyperparameters by marginal likelihood) as the teacher, it measures:

* the descent of ``||K - W K_UU W^T||_F`` from the least-squares start, by the paper's projected
  gradient and by the block least-squares direction (both with the exact line search): the
  objective, the gradient norm and the student's test SMSE after every step;
* at equal m: SGPR trained as a practitioner would (GPyTorch ``InducingPointKernel``, Titsias'
  collapsed bound, inducing points and hyperparameters by Adam from K-means), SoR (K-means U, the
  teacher's hyperparameters, not trained), KISS-GP (2-D PCA projection, trained), and distillation
  students: K-means U; the trained SGPR's U; and the exact GP with the trained SGPR's
  hyperparameters distilled at the SGPR's U;

SMSE, predictive-variance RMSE against the teacher and prediction time per 1,000 points (mean and
variance, median of repeats after a warm-up).

Run: ``python benchmarks/bench_kernel_distillation_vs_sgpr.py [--datasets ...] [--out PATH]``
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings

import gpytorch
import torch
from _problems import ExactRegressor
from _timing import cpu_name, load_line, median_time

from gpsd.data import load_dataset
from gpsd.kernel_distillation import KernelDistillation, kmeans

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=gpytorch.utils.warnings.NumericalWarning)

# name -> (m, b, KISS-GP grid points per dimension, descent steps, load_dataset kwargs)
SETTINGS = {
    "boston": (70, 20, 70, 20, {"n_train": 455, "n_test": 51, "seed": 0}),
    "concrete": (200, 30, 100, 10, {"n_test": 206}),
    "deliveries": (300, 25, 40, 4, {"n_train": 5000, "n_test": 1000}),
}


def stage(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train(model, likelihood, x, y, iters: int, lr: float) -> None:
    model.train()
    likelihood.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    for _ in range(iters):
        opt.zero_grad()
        (-mll(model(x), y)).backward()
        opt.step()
    model.eval()
    likelihood.eval()


def gp_predict(model, x, fast_var: bool = False):
    with (
        torch.no_grad(),
        gpytorch.settings.fast_pred_var(fast_var),
        gpytorch.settings.max_cholesky_size(10**6),
    ):
        post = model(x)
        return post.mean, post.variance


def smse(mean, y) -> float:
    return float((mean - y).pow(2).mean() / y.var(unbiased=False))


def student_row(student, tx, ty, ev, timing_x, repeats):
    p = student.predict(tx)
    return dict(
        smse=smse(p.mean, ty),
        var_rmse=float((p.variance - ev).pow(2).mean().sqrt()),
        time=median_time(lambda: student.predict(timing_x), repeats, tx.device),
    )


def gp_row(model, tx, ty, ev, timing_x, repeats, fast_var=False):
    mean, var = gp_predict(model, tx, fast_var)
    return dict(
        smse=smse(mean, ty),
        var_rmse=float((var - ev).pow(2).mean().sqrt()),
        time=median_time(lambda: gp_predict(model, timing_x, fast_var), repeats, tx.device),
    )


def descent_curve(teacher, m, b, steps, descent, u, tx, ty):
    """Objective, gradient norm and test SMSE after each of ``steps`` exact-line-search steps."""
    kd = KernelDistillation(
        teacher, num_inducing=m, sparsity=b, max_iter=0, inducing_points=u, descent=descent
    )
    kd.fit()
    rows, t_total = [], 0.0
    for step in range(steps + 1):
        obj, grad = kd.objective_and_gradient(kd.weight_values)
        rows.append(
            (step, float(obj.sqrt()), float(grad.norm()), smse(kd.student.predict(tx).mean, ty))
        )
        if step < steps:
            kd.max_iter = 1
            t0 = time.perf_counter()
            kd.fit()
            t_total += time.perf_counter() - t0
    return rows, t_total


def run_dataset(name, args, dtype):
    m, b, grid, steps, kw = SETTINGS[name]
    steps = steps if args.steps is None else args.steps
    split = load_dataset(name, dtype=dtype, **kw)
    x, y, tx, ty = split.train_x, split.train_y, split.test_x, split.test_y
    n, d = x.shape
    timing_x = tx.repeat(math.ceil(1000 / tx.shape[0]), 1)[:1000]
    rows, info = {}, {"n": n, "d": d, "n_test": tx.shape[0], "m": m, "b": b, "steps": steps}

    stage(f"{name}: teacher")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    sub = torch.randperm(n, generator=gen)[: min(n, args.teacher_rows)]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    lik = gpytorch.likelihoods.GaussianLikelihood()
    hyper = ExactRegressor(x[sub], y[sub], lik, kernel, constant_mean=True).to(dtype)
    with gpytorch.settings.max_cholesky_size(10**6):
        train(hyper, lik, x[sub], y[sub], args.teacher_iters, 0.1)
    teacher = ExactRegressor(x, y, lik, hyper.covar_module, constant_mean=True).to(dtype)
    teacher.mean_module.load_state_dict(hyper.mean_module.state_dict())
    teacher.eval()
    em, ev = gp_predict(teacher, tx)
    rows["exact GP (teacher)"] = gp_row(teacher, tx, ty, ev, timing_x, args.repeats)

    stage(f"{name}: SGPR")
    t0 = time.perf_counter()
    u0 = kmeans(x, m, seed=0)
    s_lik = gpytorch.likelihoods.GaussianLikelihood()
    s_base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    s_kernel = gpytorch.kernels.InducingPointKernel(s_base, inducing_points=u0, likelihood=s_lik)
    sgpr = ExactRegressor(x, y, s_lik, s_kernel, constant_mean=True).to(dtype)
    train(sgpr, s_lik, x, y, args.sgpr_iters, 0.05)
    info["sgpr_train_s"] = time.perf_counter() - t0
    rows[f"SGPR trained (U + hyperparameters, {args.sgpr_iters} Adam steps)"] = gp_row(
        sgpr, tx, ty, ev, timing_x, args.repeats
    )
    u_sgpr = s_kernel.inducing_points.detach().clone()

    stage(f"{name}: distillation")
    t0 = time.perf_counter()
    kd = KernelDistillation(teacher, num_inducing=m, sparsity=b, max_iter=0, seed=0).fit()
    info["distill_s"] = time.perf_counter() - t0
    rows["distillation: K-means U, least-squares W (T = 0)"] = student_row(
        kd.student, tx, ty, ev, timing_x, args.repeats
    )
    u_km = kd.inducing_points

    stage(f"{name}: SoR")
    sor_kernel = gpytorch.kernels.InducingPointKernel(
        copy.deepcopy(teacher.covar_module), inducing_points=u_km.clone(), likelihood=lik
    )
    sor = ExactRegressor(x, y, lik, sor_kernel, constant_mean=True).to(dtype)
    sor.mean_module.load_state_dict(teacher.mean_module.state_dict())
    sor.eval()
    rows["SoR (K-means U, teacher's hyperparameters)"] = gp_row(
        sor, tx, ty, ev, timing_x, args.repeats
    )

    stage(f"{name}: descent curves")
    curves = {}
    for descent in ("gradient", "block"):
        curves[descent] = descent_curve(teacher, m, b, steps, descent, u_km, tx, ty)
    kd_block = KernelDistillation(
        teacher, num_inducing=m, sparsity=b, max_iter=steps, inducing_points=u_km
    ).fit()
    rows[f"distillation: K-means U, T = {steps} block steps"] = student_row(
        kd_block.student, tx, ty, ev, timing_x, args.repeats
    )

    stage(f"{name}: distillation at the SGPR's U")
    kd_u = KernelDistillation(
        teacher, num_inducing=m, sparsity=b, max_iter=0, inducing_points=u_sgpr
    ).fit()
    rows["distillation: trained SGPR's U, T = 0"] = student_row(
        kd_u.student, tx, ty, ev, timing_x, args.repeats
    )
    u_fixed = None
    if not args.no_fixed_kernel_u:
        # U trained by Titsias' bound with the teacher's kernel, noise and mean held fixed
        stage(f"{name}: SGPR U with the teacher's kernel")
        f_kernel = gpytorch.kernels.InducingPointKernel(
            copy.deepcopy(teacher.covar_module), inducing_points=u0.clone(), likelihood=lik
        )
        fixed = ExactRegressor(x, y, lik, f_kernel, constant_mean=True).to(dtype)
        fixed.mean_module.load_state_dict(teacher.mean_module.state_dict())
        for p in fixed.parameters():
            p.requires_grad_(False)
        f_kernel.inducing_points.requires_grad_(True)
        train(fixed, lik, x, y, args.sgpr_iters, 0.05)
        rows["SGPR, U trained, teacher's hyperparameters fixed"] = gp_row(
            fixed, tx, ty, ev, timing_x, args.repeats
        )
        u_fixed = f_kernel.inducing_points.detach().clone()
        kd_f = KernelDistillation(
            teacher,
            num_inducing=m,
            sparsity=b,
            max_iter=0,
            inducing_points=f_kernel.inducing_points.detach().clone(),
        ).fit()
        rows["distillation at that U, T = 0"] = student_row(
            kd_f.student, tx, ty, ev, timing_x, args.repeats
        )
    # the exact GP with the trained SGPR's hyperparameters, distilled at the SGPR's U
    t2_lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    t2_lik.noise = s_lik.noise.detach()
    teacher2 = ExactRegressor(x, y, t2_lik, copy.deepcopy(s_base), constant_mean=True).to(dtype)
    teacher2.mean_module.load_state_dict(sgpr.mean_module.state_dict())
    teacher2.eval()
    rows["exact GP with the SGPR's hyperparameters"] = gp_row(
        teacher2, tx, ty, ev, timing_x, args.repeats
    )
    kd_s = KernelDistillation(
        teacher2, num_inducing=m, sparsity=b, max_iter=0, inducing_points=u_sgpr
    ).fit()
    rows["distillation of that GP at the SGPR's U, T = 0"] = student_row(
        kd_s.student, tx, ty, ev, timing_x, args.repeats
    )
    info["lengthscales"] = (
        teacher.covar_module.base_kernel.lengthscale.detach().reshape(-1),
        s_base.base_kernel.lengthscale.detach().reshape(-1),
    )

    if grid is not None and not args.no_kiss:
        stage(f"{name}: KISS-GP")
        _, _, v = torch.linalg.svd(x - x.mean(0), full_matrices=False)
        proj = v[:2].T
        kiss_kernel = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.GridInterpolationKernel(
                gpytorch.kernels.RBFKernel(ard_num_dims=2), grid_size=grid, num_dims=2
            )
        )
        k_lik = gpytorch.likelihoods.GaussianLikelihood()
        kiss = ExactRegressor(x @ proj, y, k_lik, kiss_kernel, constant_mean=True).to(dtype)
        with gpytorch.settings.max_cholesky_size(0):
            train(kiss, k_lik, x @ proj, y, args.kiss_iters, 0.1)
            rows[f"KISS-GP (2-D PCA, {grid}x{grid} grid)"] = gp_row(
                kiss, tx @ proj, ty, ev, timing_x @ proj, args.repeats, fast_var=True
            )
    stage(f"{name}: SMSE against b")
    # larger b at the same m: b = m is SoR with the student's kernel and U
    sweep = []
    choices = [("K-means U, teacher", teacher, u_km)]
    if u_fixed is not None:
        choices.append(("U trained with the teacher's kernel, teacher", teacher, u_fixed))
    choices.append(("SGPR's U, exact GP with the SGPR's hyperparameters", teacher2, u_sgpr))
    for bb in args.sweep_b:
        bb = min(bb, m)
        for label, gp, u in choices:
            kd_b = KernelDistillation(
                gp, num_inducing=m, sparsity=bb, max_iter=0, inducing_points=u
            ).fit()
            sweep.append((bb, label, student_row(kd_b.student, tx, ty, ev, timing_x, 3)))
    info["sweep"] = sweep
    return info, rows, curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--datasets", nargs="+", default=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--teacher-iters", type=int, default=60)
    parser.add_argument("--teacher-rows", type=int, default=2000)
    parser.add_argument("--sgpr-iters", type=int, default=300)
    parser.add_argument("--kiss-iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-kiss", action="store_true")
    parser.add_argument(
        "--sweep-b",
        type=int,
        nargs="*",
        default=[10, 20, 30, 40, 60, 100, 300],
        help="sparsities of the SMSE-against-b table (capped at m)",
    )
    parser.add_argument(
        "--no-fixed-kernel-u",
        action="store_true",
        help="skip SGPR with U trained and the teacher's hyperparameters fixed",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    lines = []

    def out(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    out("# Kernel distillation against trained SGPR, SoR and KISS-GP at equal m\n")
    out(f"- machine: {cpu_name()}, 2-core CPU shared with other jobs (busy), "
        f"{torch.get_num_threads()} torch thread(s); device: cpu; dtype: {args.dtype}")  # fmt: skip
    out(f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}")
    out(f"- command: `OMP_NUM_THREADS=1 python {' '.join(sys.argv)}`")
    out(f"- teacher: exact GP, ScaleKernel(ARD RBF), ConstantMean, {args.teacher_iters} Adam "
        f"steps (lr 0.1) of the marginal likelihood on <= {args.teacher_rows} rows, "
        "conditioned on all rows")  # fmt: skip
    out(f"- SGPR: GPyTorch InducingPointKernel (Titsias' collapsed bound), {args.sgpr_iters} "
        "Adam steps (lr 0.05) on U (from K-means), the kernel, noise and mean, from GPyTorch's "
        "default hyperparameters; its predictive mean is the SoR/DTC mean")  # fmt: skip
    out("- prediction time: 1000 points (test rows repeated), mean and variance, median of "
        f"{args.repeats} after a warm-up\n")  # fmt: skip
    for name in args.datasets:
        info, rows, curves = run_dataset(name, args, dtype)
        out(f"## {name}: n = {info['n']}, d = {info['d']}, test = {info['n_test']}, "
            f"m = {info['m']}, b = {info['b']}\n")  # fmt: skip
        ref = next(r for k, r in rows.items() if k.startswith("SGPR trained"))
        out("| method | SMSE | SMSE / trained SGPR's | variance RMSE vs teacher | "
            "time / 1000 pts (s) |")  # fmt: skip
        out("|---|---|---|---|---|")
        for method, r in rows.items():
            out(f"| {method} | {r['smse']:.4f} | {r['smse'] / ref['smse']:.3f} | "
                f"{r['var_rmse']:.2e} | {r['time']:.5f} |")  # fmt: skip
        ls_t, ls_s = info["lengthscales"]
        out(f"\nSGPR training {info['sgpr_train_s']:.1f} s; distillation (T = 0) "
            f"{info['distill_s']:.2f} s. Lengthscales: teacher "
            f"{', '.join(f'{v:.2f}' for v in ls_t.tolist())}; trained SGPR "
            f"{', '.join(f'{v:.2f}' for v in ls_s.tolist())}\n")  # fmt: skip
        if info["sweep"]:
            out("Distillation at larger b (same m; b = m is SoR with the student's kernel and U; "
                "time: median of 3)\n")  # fmt: skip
            out("| b | students (U, teacher) | SMSE | / trained SGPR's | time / 1000 pts (s) |")
            out("|---:|---|---:|---:|---:|")
            seen = set()
            for bb, label, r in info["sweep"]:
                if (bb, label) in seen:
                    continue
                seen.add((bb, label))
                out(f"| {bb} | {label} | {r['smse']:.4f} | {r['smse'] / ref['smse']:.3f} | "
                    f"{r['time']:.5f} |")  # fmt: skip
            out()
        g, bl = curves["gradient"], curves["block"]
        out(f"Descent from the least-squares start (K-means U): projected gradient "
            f"({g[1]:.1f} s for {info['steps']} steps) and block least-squares direction "
            f"({bl[1]:.1f} s), both with the exact line search\n")  # fmt: skip
        out("| step | gradient: ‖K − WKWᵀ‖_F | ‖∇‖ | test SMSE | block: ‖K − WKWᵀ‖_F | ‖∇‖ | "
            "test SMSE |")  # fmt: skip
        out("|---:|---:|---:|---:|---:|---:|---:|")
        for (s, f1, g1, s1), (_, f2, g2, s2) in zip(g[0], bl[0], strict=True):
            out(f"| {s} | {f1:.4f} | {g1:.3e} | {s1:.4f} | {f2:.4f} | {g2:.3e} | {s2:.4f} |")
        out()
    lines.insert(0, load_line() + "\n")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
