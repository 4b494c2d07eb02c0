"""One rank of the multi-process runs of tests/linalg/test_distributed_kernel_operator.py,
tests/linalg/test_row_split.py and
tests/kernel_distillation/test_kernel_distillation_process_group.py (started by
tests/distributed_launch.py).

Run as ``python tests/distributed_worker.py SCENARIO RANK WORLD_SIZE INIT_FILE OUT_FILE``: it
joins a gloo group through the file store ``INIT_FILE``, runs ``SCENARIO`` and saves what it
found to ``OUT_FILE`` (``torch.save``). :func:`problem` is shared with the tests.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import traceback

import gpytorch
import torch
import torch.distributed as dist
from kd_reference import Teacher

import gpsd
from gpsd.kernel_distillation._objective import SparseKernelObjective

DT = torch.float64
T = 3
NOISE = [0.1, 0.05, 0.02]
M = 50  # test points: 25 / 25 on two ranks, 17 / 17 / 16 on three
#: the timeout of the group the failure scenarios use, in seconds
SHORT_TIMEOUT = 3.0


def problem(n: int):
    """Training inputs ``(n, 2)``, targets ``(n,)``, test inputs ``(M, 2)`` and a kernel."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 2, generator=gen, dtype=DT) * 4
    y = torch.sin(x).sum(-1) + 0.1 * torch.randn(n, generator=gen, dtype=DT)
    test_x = torch.rand(M, 2, generator=gen, dtype=DT) * 4
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    kernel.base_kernel.lengthscale = 0.7
    kernel.outputscale = 1.3
    return x, y, test_x, kernel


def _combined(x, y, kernel, *, noise, **kwargs) -> gpsd.CombinedGPR:
    """The combined chain of two outer steps, each of the inner steps ``noise``."""
    return gpsd.CombinedGPR(x, y, kernel, noise=[noise, noise], **kwargs)


def _two_schedules(x, y, kernel, *, noise, **kwargs) -> gpsd.DataCentricGPR:
    """The data-centric chain with a batch of two schedules: ``noise`` and twice it."""
    return gpsd.DataCentricGPR(x, y, kernel, noise=[noise, [2 * g for g in noise]], **kwargs)


#: (name, class or factory, backend) of the models every scenario compares
MODELS = [
    ("data_lanczos", gpsd.DataCentricGPR, "lanczos"),
    ("data_lanczos_schedules", _two_schedules, "lanczos"),
    ("data_cg", gpsd.DataCentricGPR, "cg"),
    ("data_auto", gpsd.DataCentricGPR, "auto"),
    ("distribution_lanczos", gpsd.DistributionCentricGPR, "lanczos"),
    ("distribution_cg", gpsd.DistributionCentricGPR, "cg"),
    ("combined_lanczos", _combined, "lanczos"),
    ("combined_cg", _combined, "cg"),
]


def reference(n: int, process_group=None) -> dict:
    """Means, variances (and, where the backend has it, GCV) of every model of :data:`MODELS`,
    with the given process group (``None``: this process alone)."""
    x, y, test_x, kernel = problem(n)
    out = {}
    # auto goes matrix-free only beyond the dense size: lower it below N
    with gpsd.settings.dense_max_n(n // 4), torch.no_grad():
        for name, cls, backend in MODELS:
            model = cls(
                x, y, kernel, noise=NOISE, backend=backend, process_group=process_group
            ).fit()
            prediction = model.predict(test_x)
            out[name] = {
                "mean": prediction.mean,
                "variance": prediction.variance,
                "predict_mean": model.predict_mean(test_x),
                "engine": type(model._current_fit().engine).__name__,
                "split": model._current_fit().engine.columns_are_local,
                **_layout(model._current_fit().engine),
            }
            if name in (
                "data_lanczos",
                "data_lanczos_schedules",
                "data_cg",
                "combined_lanczos",
                "combined_cg",
            ):
                # CG's from the same probes on every rank
                out[name]["gcv"] = model.gcv()
                out[name]["gcv_standard_error"] = model.gcv_standard_error()
            if name == "data_lanczos":
                out[name]["step_targets"] = model.step_targets()
                covariance = model.predict(test_x[:7], full_cov=True).covariance
                out[name]["covariance"] = covariance
    return out


def _layout(engine) -> dict:
    """Which rows of the training inputs the engine's vectors hold on this rank."""
    rows = engine.local_rows
    vectors = engine.ritz_vectors
    return {
        "local_rows": None if rows is None else (rows.start, rows.stop),
        "ritz_rows": None if vectors is None else vectors.shape[-2],
        "eigenvector_rows": getattr(engine, "eigenvectors", vectors).shape[-2],
    }


#: Lanczos spectra compared directly: an uneven N on 2 and 3 ranks, a rank that leaves a
#: complement (series, power iterations), and a whole basis of a tiny N whose ranks hold fewer
#: rows than a block has columns
SPECTRUM_N = 301
TINY_N = 10


def spectrum_reference(process_group=None) -> dict:
    """A truncated Lanczos spectrum of :func:`problem`'s kernel and every form of it, and the
    whole spectrum of a tiny problem, through the group's rows (``None``: this process alone).
    Arguments with N rows are drawn whole and cut to this rank's rows; results with N rows are
    gathered."""
    out = {}
    for name, n, settings in (
        ("truncated", SPECTRUM_N, {"rank": 48, "block_size": 8, "residual_tol": 1e-6}),
        ("whole", TINY_N, {"rank": TINY_N, "block_size": 8}),
    ):
        x, _, _, kernel = problem(n)
        if process_group is None:
            op = gpsd.linalg.ChunkedKernelOperator(x, covar_module=kernel, chunk_size=64)
        else:
            op = gpsd.linalg.DistributedKernelOperator(
                x, covar_module=kernel, process_group=process_group, chunk_size=64
            )
        spectrum = gpsd.linalg.KernelSpectrum.from_lanczos(
            op, generator=torch.Generator().manual_seed(3), **settings
        )
        rows = spectrum.local_rows or slice(0, n)
        gen = torch.Generator().manual_seed(4)
        rhs = torch.randn(n, 2, generator=gen, dtype=DT)
        left = torch.randn(n, 3, generator=gen, dtype=DT)
        filt = gpsd.linalg.SpectralFilter.data_centric_weights(torch.tensor(NOISE, dtype=DT))
        coords = spectrum.project(rhs[rows])
        trace, trace_error = spectrum.trace_estimate(filt, 8, torch.Generator().manual_seed(5))
        out[name] = {
            "eigenvalues": spectrum.eigenvalues,
            "num_resolved": spectrum.num_resolved,
            "residual_norm": torch.tensor(spectrum.residual_norm),
            "complement_norm": torch.tensor(spectrum.complement_norm),  # power iterations
            "error_estimate": torch.tensor(spectrum.error_estimate(min(NOISE))),
            # V^T B up to the sign of each eigenvector (QR on rows or whole picks the sign)
            "coefficients": coords.coefficients.abs(),
            "apply": spectrum.all_rows(spectrum.apply(filt, coords)),
            "cross": spectrum.cross(filt, left[rows], coords),
            "quad_diag": spectrum.quad_diag(filt, left[rows]),
            "trace": spectrum.trace(filt),
            "trace_estimate": trace,
            "trace_error": trace_error,
            "eigenvector_rows": spectrum.eigenvectors.shape[-2],
            "ritz_rows": spectrum.ritz_vectors.shape[-2],
            "basis_size": spectrum.size,
        }
        if process_group is not None:  # all N rows where each rank must pass its own
            out[name]["full_rows"] = _caught(
                lambda spectrum=spectrum, rhs=rhs: spectrum.project(rhs)
            )
    return out


#: kernel distillation: the problem size (uneven on 2 and 3 ranks), the settings every run
#: shares (several column chunks per rank) and the runs compared, by name
KD_N = 301
KD_COMMON = {"num_inducing": 30, "sparsity": 5, "chunk_size": 40}
KD_RUNS = {
    "block": {"max_iter": 2},  # the block direction with the exact line search
    "gradient": {"max_iter": 2, "descent": "gradient", "lr": 1e-3},
}
KD_NOISE = 0.1
KD_MEAN = 0.3


def kd_reference(process_group=None) -> dict:
    """W, errors and the student's predictions of every run of :data:`KD_RUNS` (through
    ``from_data``) and of a teacher's distillation, with the given process group (``None``:
    this process alone), with the columns of K_XX each evaluated."""
    x, y, test_x, kernel = problem(KD_N)
    mean = gpytorch.means.ConstantMean().to(DT)
    mean.constant = KD_MEAN
    out = {}
    for name, settings in KD_RUNS.items():
        columns = []
        with _recording_columns(columns):
            distiller = gpsd.KernelDistillation.from_data(
                x,
                y,
                kernel,
                noise=KD_NOISE,
                mean_module=mean,
                process_group=process_group,
                **KD_COMMON,
                **settings,
            ).fit()
        out[name] = _kd_result(distiller, test_x)
        out[name]["columns"] = columns
        block = distiller._objective().block
        out[name]["block"] = (block.start, block.stop)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    likelihood.noise = KD_NOISE
    teacher = Teacher(x, y, likelihood)
    distiller = gpsd.KernelDistillation(
        teacher, max_iter=1, process_group=process_group, **KD_COMMON
    ).fit()
    out["teacher"] = _kd_result(distiller, test_x)
    return out


class _recording_columns:
    """Within it, every block of columns of K_XX that kernel distillation evaluates is
    appended to ``columns`` as ``(start, stop)``."""

    def __init__(self, columns: list) -> None:
        self.columns = columns

    def __enter__(self):
        cls = SparseKernelObjective
        self.original = original = cls.columns
        columns = self.columns

        def recorded(objective, start):
            cols, k_cols = original(objective, start)
            columns.append((cols.start, cols.stop))
            assert k_cols.shape == (objective.train_x.shape[0], cols.stop - cols.start)
            return cols, k_cols

        cls.columns = recorded
        return self

    def __exit__(self, *exc) -> None:
        SparseKernelObjective.columns = self.original


def _kd_result(distiller, test_x) -> dict:
    prediction = distiller.student.predict(test_x)
    return {
        "weights": distiller.weight_values,
        "initial_weights": distiller.initial_weight_values,
        "errors": torch.tensor(distiller.frobenius_errors, dtype=DT),
        "mean": prediction.mean,
        "variance": prediction.variance,
        "inducing_points": distiller.inducing_points,
        "neighbour_indices": distiller.neighbour_indices,
        "inducing_covariance": distiller.inducing_covariance,
    }


def scenario_kd(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    out = {"distributed": kd_reference(group), "plain": kd_reference()}
    x, y, _, kernel = problem(KD_N)

    def build(x=x, kernel=kernel, **settings):
        return gpsd.KernelDistillation.from_data(
            x, y, kernel, noise=KD_NOISE, process_group=group, **{**KD_COMMON, **settings}
        )

    # a different problem on the last rank: a ValueError on every rank
    last = rank == world - 1
    other_x = x.clone()
    if last:
        other_x[0, 0] += 1e-12
    out["different_train_x"] = _caught(lambda: build(x=other_x))
    other_kernel = problem(KD_N)[3]
    if last:
        other_kernel.base_kernel.lengthscale = 0.71
    out["different_kernel"] = _caught(lambda: build(kernel=other_kernel))
    out["different_settings"] = _caught(lambda: build(sparsity=6 if last else 5))
    return out


def _group_of_one(rank: int, world: int):
    """A group holding this rank alone (every rank creates every such group, in order)."""
    groups = [dist.new_group([r]) for r in range(world)]
    return groups[rank]


def _caught(run) -> dict:
    """What ``run()`` raised: its type and message, with the time it took."""
    start = time.perf_counter()
    try:
        run()
    except Exception as err:  # the scenarios record what every rank sees
        return {"type": type(err).__name__, "message": str(err), "seconds": _since(start)}
    return {"type": None, "message": "", "seconds": _since(start)}


def _since(start: float) -> float:
    return time.perf_counter() - start


def scenario_main(rank: int, world: int) -> dict:
    n = 300 if world == 2 else 301
    out = {"models": reference(n, dist.group.WORLD)}
    x, _, test_x, kernel = problem(n)
    operator = gpsd.linalg.DistributedKernelOperator(
        x, covar_module=kernel, process_group=dist.group.WORLD, chunk_size=64
    )
    rhs = torch.randn(n, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    out["product"] = operator @ rhs
    out["diagonal"] = operator.diagonal(dim1=-2, dim2=-1)
    out["rows"] = (operator.rows.start, operator.rows.stop)
    if world == 2:  # a group of one: the plain path, within this process
        out["alone"] = reference(n, _group_of_one(rank, world))
    out["plain"] = reference(n)
    # different inputs, kernels or test points on one rank: a ValueError on every rank
    other_x = x.clone()
    if rank == world - 1:
        other_x[0, 0] += 1e-12
    out["different_x"] = _caught(
        lambda: gpsd.linalg.DistributedKernelOperator(
            other_x, covar_module=kernel, process_group=dist.group.WORLD
        )
    )
    other_kernel = problem(n)[3]
    if rank == world - 1:
        other_kernel.base_kernel.lengthscale = 0.71
    y = problem(n)[1]
    out["different_kernel"] = _caught(
        lambda: gpsd.DataCentricGPR(
            x, y, other_kernel, noise=NOISE, backend="lanczos", process_group=dist.group.WORLD
        ).fit()
    )
    # targets, noise schedules or prior means that differ on one rank, on every backend
    last = rank == world - 1
    other_y = y + (1e-3 if last else 0.0)
    other_noise = [0.1, 0.05, 0.03 if last else 0.02]
    other_mean = gpytorch.means.ConstantMean().to(DT)
    other_mean.constant = 0.1 if last else 0.0
    for backend in ("lanczos", "cg", "auto"):
        for case, kwargs in (
            ("y", {"train_y": other_y}),
            ("noise", {"noise": other_noise}),
            ("mean", {"mean_module": other_mean}),
        ):
            arguments = {"train_y": y, "noise": NOISE, **kwargs}
            out[f"different_{case}_{backend}"] = _caught(
                lambda arguments=arguments, backend=backend: gpsd.DataCentricGPR(
                    x,
                    covar_module=kernel,
                    backend=backend,
                    process_group=dist.group.WORLD,
                    **arguments,
                ).fit()
            )
    # the direct backends would ignore the group: refused on every rank
    for backend in ("dense", "cholesky"):
        out[f"group_with_{backend}"] = _caught(
            lambda backend=backend: gpsd.DataCentricGPR(
                x, y, kernel, noise=NOISE, backend=backend, process_group=dist.group.WORLD
            ).fit()
        )
    # a right-hand side that differs on one rank: the replicated iterations have diverged
    other_rhs = rhs + (1e-3 if rank == world - 1 else 0.0)
    out["different_rhs"] = _caught(lambda: operator @ other_rhs)
    # ranks whose automatic choices differ (as their free memory may) agree on the most
    # matrix-free one: here the last rank alone would choose a dense backend
    with gpsd.settings.dense_max_n(n if rank == world - 1 else n // 4), torch.no_grad():
        model = gpsd.DataCentricGPR(x, y, kernel, noise=NOISE, process_group=dist.group.WORLD)
        out["disagreeing_auto"] = {
            "mean": model.predict(test_x).mean,
            "engine": type(model._current_fit().engine).__name__,
        }
    model = gpsd.DataCentricGPR(
        x, y, kernel, noise=NOISE, backend="lanczos", process_group=dist.group.WORLD
    )
    other_test = test_x + (1e-3 if rank == 0 else 0.0)
    out["different_test_x"] = _caught(lambda: model.predict(other_test))
    out["spectrum"] = spectrum_reference(dist.group.WORLD)
    out["plain_spectrum"] = spectrum_reference()
    out["mll"] = scenario_mll(rank, world)  # in the same processes: no second start
    return out


def scenario_row_split(rank: int, world: int) -> dict:
    """The sums and the TSQR of :class:`gpsd.linalg._row_split.SplitRows` on this rank's rows
    of matrices drawn whole: ``(N, c)`` of 7 x 3 (ranks with fewer rows than columns on 3
    ranks) and 40 x 5; results with N rows gathered."""
    from gpsd.linalg._row_split import SplitRows

    out = {}
    for n, c in ((7, 3), (40, 5)):
        x, _, _, kernel = problem(n)
        op = gpsd.linalg.DistributedKernelOperator(
            x, covar_module=kernel, process_group=dist.group.WORLD, chunk_size=4
        )
        rows = SplitRows(op, DT)
        gen = torch.Generator().manual_seed(6)
        z = torch.randn(2, n, c, generator=gen, dtype=DT)  # a batch of two
        w = torch.randn(2, n, 2, generator=gen, dtype=DT)
        q, r = rows.qr(rows.take(z))
        out[(n, c)] = {
            "q": rows.gather(q),
            "r": r,
            "gram": rows.gram(rows.take(z), rows.take(w)),
            "norm": rows.norm(rows.take(z)),
            "product": rows.gather(rows.matmul(rows.take(z))),
            "mine": rows.take(z).shape[-2],
        }
    return out


def scenario_keops(rank: int, world: int) -> dict:
    """The kernel of :func:`problem` as a GPyTorch KeOps kernel (needs pykeops), through KeOps
    from 2 rows on (GPyTorch evaluates blocks smaller than ``max_cholesky_size`` densely, the
    diagonal's 1 x 1 blocks among them): each rank's rows go through KeOps reductions."""
    n = 300
    x, y, test_x, kernel = problem(n)
    keops = gpytorch.kernels.ScaleKernel(gpytorch.kernels.keops.RBFKernel()).to(DT)
    keops.base_kernel.lengthscale = kernel.base_kernel.lengthscale.detach()
    keops.outputscale = kernel.outputscale.detach()
    group = dist.group.WORLD
    rhs = torch.randn(n, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    out = {}
    with gpytorch.settings.max_cholesky_size(2), torch.no_grad():
        for turn in range(world):  # one rank at a time compiles (or loads) the KeOps formula
            if turn == rank:
                keops(x[:2], x) @ rhs
            dist.barrier()
        operator = gpsd.linalg.DistributedKernelOperator(x, covar_module=keops, process_group=group)
        out["local"] = type(operator.local).__name__
        out["product"] = operator @ rhs
        out["diagonal"] = operator.diagonal(dim1=-2, dim2=-1)
        model = gpsd.DataCentricGPR(
            x, y, keops, noise=NOISE, backend="lanczos", process_group=group
        )
        prediction = model.predict(test_x)
        out["mean"], out["variance"] = prediction.mean, prediction.variance
        plain = gpsd.DataCentricGPR(x, y, kernel, noise=NOISE, backend="lanczos").predict(test_x)
        out["plain_mean"], out["plain_variance"] = plain.mean, plain.variance
    return out


def scenario_fail(rank: int, world: int, how: str, out_file: str) -> dict:
    """Rank 1 fails in the middle of the Lanczos iterations (raises, then stays until rank 0
    has saved what it saw; or exits)."""
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=SHORT_TIMEOUT))
    x, y, _, kernel = problem(300)

    def callback(record):
        if rank == 1:
            if how == "exit":
                os._exit(3)
            raise RuntimeError("rank 1 fails on purpose")

    model = gpsd.DataCentricGPR(
        x, y, kernel, noise=NOISE, backend="lanczos", rank=64, process_group=group
    )
    out = {"fit": _caught(lambda: model.fit(callback=callback))}
    first = os.path.join(os.path.dirname(out_file), "rank0.pt")
    start = time.perf_counter()
    while rank == 1 and not os.path.exists(first) and _since(start) < SHORT_TIMEOUT + 30:
        time.sleep(0.1)  # stay until rank 0 has given up waiting
    return out


def tight_cg():
    """GPyTorch's matrix-free route with preconditioned CG converged far below its default
    tolerance: a loose one (or CG run past N iterations without converging) stops where
    rounding, which depends on how the rows are split, moves the iterates."""
    stack = contextlib.ExitStack()
    stack.enter_context(gpytorch.settings.max_cholesky_size(0))
    stack.enter_context(gpytorch.settings.cg_tolerance(1e-7))
    stack.enter_context(gpytorch.settings.max_cg_iterations(150))
    stack.enter_context(gpytorch.settings.min_preconditioning_size(1))
    stack.enter_context(gpytorch.settings.max_preconditioner_size(40))
    return stack


def mll_reference(n: int, process_group=None) -> dict:
    """The differentiable kernel operators through the group (``None``: this process alone):
    a bilinear derivative, GPyTorch's matrix-free marginal likelihood with its gradient (the
    same seeded probes on every rank), an ExactGP with a ``ChunkedKernel`` under
    ``ExactMarginalLogLikelihood``, and two iterations of ``optimize_hyperparameters`` on
    the CG backend, on ``n`` points."""
    from gpsd.distillation._teacher_likelihood import matrix_free_log_likelihood, seeded_probes

    x, y, _, kernel = problem(n)
    out = {}
    gen = torch.Generator().manual_seed(1)
    left, right = (
        torch.randn(n, 3, generator=gen, dtype=DT),
        torch.randn(n, 3, generator=gen, dtype=DT),
    )
    if process_group is None:
        op = gpsd.linalg.ChunkedKernelOperator(
            x, covar_module=kernel, chunk_size=16, cache_bytes=10**7
        )
        rows = op
    else:
        op = gpsd.linalg.DistributedKernelOperator(
            x, covar_module=kernel, process_group=process_group, chunk_size=16, cache_bytes=10**7
        )
        rows = op.local
    with torch.no_grad():
        op @ right  # keeps this rank's rows
    out["kept_before_backward"] = rows.kept_bytes
    grads = op._bilinear_derivative(left, right)[1 if process_group is None else 2 :]
    out["kept_after_backward"] = rows.kept_bytes
    out["form_grads"] = [g.detach() for g in grads]
    mean = gpytorch.means.ConstantMean().to(DT)
    noise = torch.tensor(0.05, dtype=DT, requires_grad=True)
    params = [*kernel.parameters(), *mean.parameters(), noise]
    with tight_cg(), seeded_probes(1, torch.device("cpu")):
        value = matrix_free_log_likelihood(kernel, mean, x, y, noise, process_group)
        out["mll"] = value.detach()
        out["mll_grads"] = [g.detach() for g in torch.autograd.grad(value, params)]

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            likelihood = gpytorch.likelihoods.GaussianLikelihood()
            super().__init__(x, y, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpsd.kernels.ChunkedKernel(
                gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()),
                chunk_size=16,
                process_group=process_group,
            )

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(z), self.covar_module(z)
            )

    model = GP().to(DT)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with tight_cg(), seeded_probes(2, torch.device("cpu")):
        loss = -mll(model(x), y)
        out["exactgp_loss"] = loss.detach()
        out["exactgp_grads"] = [
            g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))
        ]
    _, _, _, kernel = problem(n)
    distiller = gpsd.DataCentricGPR(
        x, y, kernel, noise=NOISE, backend="cg", process_group=process_group
    )
    with tight_cg():
        distiller.optimize_hyperparameters(max_iter=2, lr=0.1)
    out["trained"] = [p.detach().clone() for p in kernel.parameters()]
    out["trained_noise"] = distiller.noise.clone()
    out["history"] = list(distiller.history)
    return out


def scenario_mll(rank: int, world: int) -> dict:
    n = 100 if world == 2 else 101  # 34, 34 and 33 rows on 3 ranks
    out = {"group": mll_reference(n, dist.group.WORLD), "rank": rank}
    if rank == 0:  # one process's answer, for every rank's to be compared with
        out["single"] = mll_reference(n)
    return out


def scenario_rows(rank: int, world: int) -> dict:
    """gpsd.linalg.shared_rows.on_my_rows: the rows each rank computes, and what it gathers."""
    from gpsd.linalg.shared_rows import on_my_rows

    group = dist.group.WORLD
    out = {"rank": rank, "seen": []}

    def compute(part):  # (2, m, 3) to (2, 4, m): every rank computes one formula
        out["seen"].append(part.clone())
        return torch.stack([part.sum(-1), part.prod(-1), part[..., 0], part[..., 2] ** 2], dim=-2)

    rows = torch.arange(2 * 5 * 3, dtype=DT).reshape(2, 5, 3).sin()
    out["five"] = on_my_rows(rows, compute, group)
    out["one"] = on_my_rows(rows[:, :1], compute, group)  # the last rank computes none
    # rank 1 passes other values: every rank raises the same error, naming the argument
    other = rows + (rank == 1)
    out["differ"] = _caught(lambda: on_my_rows(other, compute, group, name="val_x"))
    return out


def main() -> None:
    scenario, rank, world, init_file, out_file = sys.argv[1:]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    torch.exp(torch.zeros(1, dtype=DT))  # see tests/conftest.py
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        if scenario == "main":
            result = scenario_main(rank, world)
        elif scenario == "kd":
            result = scenario_kd(rank, world)
        elif scenario == "rows":
            result = scenario_rows(rank, world)
        elif scenario == "keops":
            result = scenario_keops(rank, world)
        elif scenario == "row_split":
            result = scenario_row_split(rank, world)
        else:
            result = scenario_fail(rank, world, scenario.removeprefix("fail_"), out_file)
    except Exception:
        result = {"crashed": traceback.format_exc()}
    torch.save(result, out_file + ".part")
    os.replace(out_file + ".part", out_file)  # whole, for a rank that waits for it
    sys.stdout.flush()
    os._exit(0)  # no teardown of a group that a failed rank has left


if __name__ == "__main__":
    main()
