"""Kernel distillation (Song & Sun): fit a sparse low-rank ``W K_UU W^T`` to a GP's kernel."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import gpytorch
import numpy as np
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ExactGP
from torch import Tensor

from gpsd._internal.collectives import (
    all_gather,
    all_gather_cat,
    all_reduce_sum,
    check_group,
    check_same,
    module_fingerprint,
    split_sizes,
    tensor_fingerprint,
    text_checksum,
)
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.stationary_kernel import (
    check_lengthscale_count,
    evaluate_kernel,
    stationary_kernel_parameters,
)
from gpsd._internal.teacher import frozen_copy, validate_teacher
from gpsd._internal.user_warning import warn
from gpsd._internal.validation import (
    as_float_tensor,
    check_int,
    check_matrix,
    check_positive_float,
    check_same_device,
    check_vector,
)
from gpsd.exceptions import NotFittedError, TeacherError
from gpsd.kernel_distillation.kmeans import kmeans
from gpsd.kernel_distillation.nearest_inducing import nearest_inducing_points
from gpsd.kernel_distillation.sparse_low_rank_student import SparseLowRankStudent
from gpsd.progress import Callback

__all__ = ["KernelDistillation"]

#: Elements of the temporaries of one block of K_XX columns or of least-squares rows.
_CHUNK_ELEMENTS = 2**22
#: Training inputs on which a teacher's ``forward`` is compared with its modules.
_FORWARD_CHECK_POINTS = 8


def _mean_constant(mean_module: object, name: str) -> float:
    """The prior mean of ``mean_module`` (``None``, a ``ZeroMean`` or a one-constant
    ``ConstantMean``) as a finite Python float, or an error naming ``name``."""
    if mean_module is None or isinstance(mean_module, gpytorch.means.ZeroMean):
        return 0.0
    if isinstance(mean_module, gpytorch.means.ConstantMean) and mean_module.constant.numel() == 1:
        value = float(mean_module.constant.detach())
        if not np.isfinite(value):
            raise ValueError(f"{name}'s constant must be finite, got {value}")
        return value
    raise TypeError(
        f"{name} must be None, a ZeroMean or a ConstantMean, got {type(mean_module).__name__}"
    )


def _forward_matches_modules(
    teacher: ExactGP, kernel: gpytorch.kernels.Kernel, mean_constant: float, train_x: Tensor
) -> bool:
    r"""Whether ``teacher.forward`` is the prior of ``kernel`` and ``mean_constant`` (the
    teacher's ``covar_module`` and ``mean_module``) on the first few raw training inputs.

    ``forward`` runs with the teacher in evaluation mode, as it predicts (no dropout, no
    batch-norm statistics updated); every submodule's mode is restored afterwards. The kernel is
    evaluated by GPyTorch as ``forward`` evaluates it, so a standard ``forward`` agrees exactly;
    a difference above :math:`10^{-4}` of the kernel's largest entry (of its square root plus the
    constant, for the mean) counts.
    """
    x = teacher.train_inputs[0][:_FORWARD_CHECK_POINTS]
    k = x.shape[0]
    modes = [(module, module.training) for module in teacher.modules()]
    teacher.eval()
    try:
        with torch.no_grad():
            prior = teacher.forward(x)
            if not isinstance(prior, MultivariateNormal) or prior.event_shape != (k,):
                return False
            mean, covariance = prior.mean.detach(), prior.covariance_matrix.detach()
    finally:
        for module, training in modes:
            module.training = training
    with torch.no_grad(), gpytorch.settings.lazily_evaluate_kernels(False):
        expected = kernel(train_x[:k]).to_dense()
    scale = float(expected.abs().max())
    covariance_error = float((covariance - expected).abs().max())
    mean_error = float((mean - mean_constant).abs().max())
    return covariance_error <= 1e-4 * scale and mean_error <= 1e-4 * (
        scale**0.5 + abs(mean_constant)
    )


def _batched_least_squares(design: Tensor, rhs: Tensor, gram: Tensor) -> Tensor:
    r"""``argmin_beta ||design^T beta - rhs||`` for a batch of wide ``(b, m)`` designs, ``b <= m``.

    Normal equations with a batched Cholesky factor of the Gram matrix :math:`G = D D^\top`
    (``gram``, passed in because the caller gathers it from a precomputed matrix) and six steps of
    iterative refinement on the directly computed residual (batched QR of tall matrices is very
    slow on CPUs). A refinement step multiplies the error by about :math:`\rho \approx
    \kappa(G)\, \epsilon`, so a row whose last correction :math:`\delta` is at most
    :math:`\sqrt\epsilon\, \|\beta\|` has converged (its error is about
    :math:`\rho \|\delta\| / (1 - \rho)`). The other rows, and those whose Cholesky
    factorisation fails or whose Cholesky diagonal spans more than :math:`\sqrt\epsilon`, are
    re-solved by an SVD-based least squares (minimum-norm solution).

    A test on the conditioning alone does not do: the spread of the Cholesky diagonal only bounds
    :math:`\kappa(G)^{1/2}` from below, and rows with :math:`\kappa(D) \approx 8 \times 10^9`
    passed it with residuals :math:`10^6` times the least squares'; a test on ``eigvalsh`` of
    :math:`G` (:math:`\lambda_{\min} \le 1000 \epsilon \lambda_{\max}`) sends rows to the SVD
    that refinement solves: at n = 16,384, m = 1000, b = 30, RBF lengthscale 1.5 it took 10.2 s
    where this takes 3.7 s, for the same start (the diagonal test with two refinement steps
    alone: 2.2 s, and a start 0.5 % farther from :math:`K_{XX}`).

    :param design: shape ``(c, b, m)``; :param rhs: shape ``(c, m)``; :param gram: shape
        ``(c, b, b)``; returns shape ``(c, b)``.
    """
    eps = torch.finfo(design.dtype).eps
    chol, info = torch.linalg.cholesky_ex(gram)
    diag = chol.diagonal(dim1=-2, dim2=-1).abs()
    bad = (info != 0) | (diag.min(-1).values <= 10 * eps**0.5 * diag.max(-1).values)
    chol = torch.where(
        bad[:, None, None], torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device), chol
    )
    sol = torch.cholesky_solve((design @ rhs.unsqueeze(-1)), chol)  # shape: (c, b, 1)
    for _ in range(6):
        resid = rhs.unsqueeze(-1) - design.transpose(-1, -2) @ sol  # shape: (c, m, 1)
        correction = torch.cholesky_solve(design @ resid, chol)
        sol = sol + correction
    sol, correction = sol.squeeze(-1), correction.squeeze(-1)
    bad = bad | ~(correction.norm(dim=-1) <= eps**0.5 * sol.norm(dim=-1))  # NaN: not converged
    if bool(bad.any()):
        tall, target = design[bad].transpose(-1, -2), rhs[bad].unsqueeze(-1)
        if design.device.type == "cpu":
            sol[bad] = torch.linalg.lstsq(tall, target, driver="gelsd").solution.squeeze(-1)
        else:
            sol[bad] = (torch.linalg.pinv(tall) @ target).squeeze(-1)
    return sol


class _SparseRows:
    """``W`` with ``b`` non-zeros per row: ``values (n, b)`` at columns ``indices (n, b)``.

    ``W`` and ``W^T`` are built as compressed-row (CSR) tensors, whose products with dense
    matrices run about twice as fast as the coordinate (COO) layout's on a CPU (n = 8192,
    m = 1000, b = 30, 2048 columns: 0.14 s against 0.26 s in float32). Indices are sorted within
    each row; the permutation to column-major order (the rows of ``W^T``) is computed once.
    """

    def __init__(self, indices: Tensor, num_columns: int) -> None:
        self.indices = indices
        self.n, self.b = indices.shape
        self.m = num_columns
        device = indices.device
        self.crow = torch.arange(0, self.n * self.b + 1, self.b, device=device)
        self.col = indices.reshape(-1)
        rows = torch.arange(self.n, device=device).repeat_interleave(self.b)
        self.t_order = torch.argsort(self.col * self.n + rows)
        self.t_col = rows[self.t_order]
        counts = torch.bincount(self.col, minlength=self.m)
        self.t_crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    @staticmethod
    def _csr(crow: Tensor, col: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
        with warnings.catch_warnings():  # torch calls its CSR support "beta" on first use
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support")
            return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)

    def matrix(self, values: Tensor) -> Tensor:
        return self._csr(self.crow, self.col, values.reshape(-1), (self.n, self.m))

    def rows(self, values: Tensor, rows: slice) -> Tensor:
        """Rows ``rows`` (a slice with step 1) of ``W``."""
        start, stop, _ = rows.indices(self.n)
        crow = self.crow[: stop - start + 1]
        col = self.col[start * self.b : stop * self.b]
        return self._csr(crow, col, values[rows].reshape(-1), (stop - start, self.m))

    def transpose(self, values: Tensor) -> Tensor:
        values = values.reshape(-1)[self.t_order]
        return self._csr(self.t_crow, self.t_col, values, (self.m, self.n))

    def dense(self, values: Tensor) -> Tensor:
        out = values.new_zeros(self.n, self.m)
        return out.scatter_(-1, self.indices, values)


class KernelDistillation:
    r"""Distil a trained exact GP into a :class:`~gpsd.SparseLowRankStudent` (Song & Sun, Alg. 1).

    The teacher's kernel matrix :math:`K_{XX}` is approximated by :math:`W K_{UU} W^\top`, with
    :math:`U` the ``m`` K-means centroids of the training inputs and :math:`W` sparse: row ``i`` has
    ``b`` non-zeros at the ``b`` inducing points nearest to :math:`x_i` (the set :math:`J_i`):

    .. math::
        \min_W \; \|K_{XX} - W K_{UU} W^\top\|_F^2 \quad \text{s.t.} \quad
        W_{ij} = 0 \text{ for } j \notin J_i .

    *Initialisation* (§2): each row solves the least-squares problem
    :math:`\min_\beta \|\beta\, K_{UU}(J_i, :) - k(x_i, U)\|_2` (a batch of ``m x b`` problems).
    *Projected gradient descent*: the gradient of the squared objective is

    .. math::
        \nabla_W = 4\, (W K_{UU} W^\top - K_{XX})\, W K_{UU},

    kept only on the sparsity pattern. (Algorithm 1 of the paper writes
    :math:`E^\top W K_{UU}` with the diagonal of :math:`E` doubled; that is not the gradient of the
    stated objective, so the exact gradient is used here; the factor is checked against autograd.)
    *Descent directions*: ``descent="block"`` (the default with the exact line search)
    preconditions the gradient row by row with the Hessian block of the left factor,
    :math:`D_i = G(J_i, J_i)^{-1} \nabla_W(i, J_i) / 4`,
    :math:`G = K_{UU} W^\top W K_{UU}` (:meth:`block_direction`): ``W - D`` is one exact
    alternating least-squares step. Steepest descent zigzags on this problem: on Boston
    (n = 455, m = 70, b = 20) 20 exact-line-search gradient steps lower the error by 1.6 %
    (4.566 to 4.495; the gradient norm stays at 11 to 27), 20 block steps by 29 % (to 3.258)
    in about the same time (2.6 s against 3.2 s on a busy CPU;
    ``benchmarks/results/kernel_distillation_vs_sgpr.md``).
    ``descent="gradient"`` takes the projected gradient itself.
    ``lr=None`` (default) takes the exact line-search step along the direction
    (the objective is a quartic in the step, whose coefficients one extra pass gives); a float
    :math:`s` takes fixed steps :math:`W \leftarrow W - s\, P(4 E W K_{UU})`
    (:math:`E = W K_{UU} W^\top - K_{XX}`, :math:`P` keeping the pattern). The paper's step with
    rate :math:`\eta` is :math:`W \leftarrow W - \eta\, P(E' W K_{UU})` with
    :math:`E' = E + \operatorname{diag}(E)`, so :math:`s = \eta / 4` takes the paper's step less
    its diagonal term :math:`\eta\, P(\operatorname{diag}(E) W K_{UU})`: close to it, not equal
    (after 5 steps of :math:`\eta = 2 \times 10^{-4}` at n = 200, m = 20, b = 4, :math:`s = \eta/4`
    gives a ``W`` within :math:`4 \times 10^{-6}` relative of the paper's, :math:`s = \eta` within
    :math:`4 \times 10^{-5}`).
    ``optimizer`` plugs in any ``torch.optim`` optimiser.

    This distils ``teacher.covar_module`` and ``teacher.mean_module`` applied to the raw training
    inputs, the GPyTorch convention for an ``ExactGP`` whose ``forward`` is
    ``MultivariateNormal(mean_module(x), covar_module(x))``. A teacher whose ``forward``
    transforms the inputs first (scaling, a feature extractor as in deep kernel learning) is a
    different GP, which the student does not reproduce; the constructor compares ``forward`` with
    the two modules on a few training inputs and warns when they differ.

    :math:`K_{XX}` is never formed: every pass evaluates it in blocks of ``chunk_size`` columns
    (memory :math:`O(n \cdot \text{chunk} + \text{chunk} \cdot b m)`), and products with :math:`W`
    use sparse matrices, so a pass costs :math:`O(n^2 (d + b) + n m^2)` time: the blocks of
    :math:`K_{XX}` and the products with :math:`W` take :math:`O(n^2 (d + b))`, the product
    :math:`(E W) K_{UU}` of the gradient :math:`O(n m^2)` (about a quarter of the pass at
    n = 4096, m = 1000, b = 20, d = 2: 0.14 s of 0.63 s in float64 on one CPU thread). The
    objective alone and the line search skip that product: :math:`O(n^2 (d + b))`.

    **Across processes.** With a ``process_group`` (a ``torch.distributed.ProcessGroup``), the
    ranks share the passes over :math:`K_{XX}`; the maths does not change. The ``n`` columns of
    :math:`K_{XX}` (= its rows, :math:`K_{XX}` being symmetric) are split into contiguous
    blocks, one per rank of :math:`P`, as even as can be (the first :math:`n \bmod P` ranks one
    more), and every pass evaluates on each rank only the columns of its block, in chunks of
    ``chunk_size``. The objective and the six coefficients of the line search are sums over
    columns: each rank's partial sums are added over the ranks (gathered and added in rank
    order, so that every rank holds the same bits); the gradient's rows of each block are
    gathered (``all_gather``). The per-row work is split by the same rows and gathered too: the
    least-squares start (:math:`O(n b (m + b^2))`) and the solves of the block direction
    (:math:`O(n b^3)`). Every rank thus holds the same :math:`W` after every iteration and ends
    with the same ``frobenius_errors`` and student as one process, to rounding (the partial sums
    are added in another order).

    * **Each rank holds** the inputs :math:`X` whole (:math:`n \times d`), the targets,
      :math:`W` replicated (:math:`n \times b` values and their pattern), the gradient and the
      direction (:math:`n \times b`), :math:`K_{UU}` and the Gram matrix :math:`G` of the block
      direction (:math:`m \times m`), and one chunk of its block of columns of :math:`K_{XX}`
      (:math:`n \times` ``chunk_size``) with its temporaries.
    * **Communication per pass**: one scalar (the objective) or six (the line search) from
      every rank, and, for the gradient and the block direction, an ``all_gather`` of the
      :math:`n \times b` rows (each rank receives :math:`P \lceil n/P \rceil b` values).
    * **Time per rank** per pass: :math:`O(n^2 (d + b) / P)`, plus :math:`O(n m^2 / P)` for the
      product :math:`(E W) K_{UU}` of the gradient. Replicated on every rank: K-means (every
      rank takes rank 0's centroids, ``m x d`` values gathered once, since on GPUs K-means adds
      with atomics whose order varies), the nearest-inducing search, :math:`K_{UU}`, the matrix
      :math:`G` (:math:`O(n b^2 + m^3)`) and the student (:class:`~gpsd.SparseLowRankStudent`,
      :math:`O(n b^2 + m^3)`). What is gathered or summed over the ranks (:math:`W`, the errors)
      is the same bits on every rank; on the CPU the student is too, while on GPUs its
      predictions can differ across ranks by rounding (sums with atomics).

    Construction with a group is collective: every rank compares the shape, dtype and an exact checksum
    of the bits of ``train_x``, ``train_y``, the noise, the mean constant, the kernel's
    hyperparameters (and its module types), the inducing points and the settings with every
    other rank's, and where any differ every rank raises the same ``ValueError`` naming what
    differs. :meth:`prepare`, :meth:`least_squares_weights`, :meth:`objective_and_gradient`,
    :meth:`frobenius_error`, :meth:`block_direction` and :meth:`fit` are collective too: every
    rank calls them in the same order with the same arguments (a
    ``callback`` must stop the preparation and the descent on every rank alike). A collective that fails or waits
    longer than the group's ``timeout`` raises a :class:`~gpsd.DistributedError`. Collectives
    run on the tensors' device with NCCL, on the CPU with gloo.

    Usage::

        distiller = KernelDistillation(teacher, num_inducing=100, sparsity=10).fit()
        prediction = distiller.student.predict(test_x)  # a gpsd.Prediction

    :param teacher: a trained ``gpytorch.models.ExactGP`` with a ``GaussianLikelihood``, a
        ``ZeroMean`` or ``ConstantMean`` and no batch shape. "Trained" is checked as: training
        data set (``train_inputs``/``train_targets`` not ``None``) and, with
        ``require_trained=True``, not every raw hyperparameter still at GPyTorch's initial value 0.
        Use :meth:`from_data` to pass ``(train_x, train_y, covar_module, noise=...)`` instead. Its
        kernel, noise and mean are copied here: training the teacher further does not reach the
        distillation.
    :param num_inducing: ``m``, number of inducing points (``b <= m <= n``).
    :param sparsity: ``b``, non-zeros per row of :math:`W`.
    :param max_iter: the most descent iterations one :meth:`fit` takes. The default 0 keeps the
        least-squares start: on Boston, concrete and deliveries no descent lowers the student's
        test SMSE for good (the gradient leaves it within 0.0001; the block descent raises it
        from the second step on, Boston 0.0943, 0.0907 after one step, 0.1041 after 20;
        ``benchmarks/results/kernel_distillation_vs_sgpr.md``), while the block descent does
        lower :math:`\|K_{XX} - W K_{UU} W^\top\|_F`, which is what kernel reconstruction
        (Appendix B) measures.
    :param lr: fixed step :math:`s` of the descent; ``None`` for the exact line search.
    :param optimizer: a factory ``params -> torch.optim.Optimizer`` used instead of plain descent
        (its learning rate is the optimiser's; give no ``lr`` with it).
    :param descent: ``"block"`` (block least-squares direction) or ``"gradient"`` (projected
        gradient); ``None`` (default): ``"block"`` with the exact line search, ``"gradient"``
        with ``lr`` or ``optimizer`` (the block direction takes the line search only).
    :param inducing_points: optional ``(m, d)`` inducing points, used as given (skips
        K-means); :meth:`from_sgpr` takes them, with the kernel, from a trained SGPR.
    :param kmeans_max_iter: the most Lloyd iterations of K-means.
    :param seed: seed of the k-means++ seeding.
    :param chunk_size: columns of :math:`K_{XX}` per block (default: about :math:`2^{22}/n`).
    :param jitter: the student's relative jitter (see :class:`~gpsd.SparseLowRankStudent`).
    :param neighbour_metric: ``"lengthscale"`` (default) runs K-means and the nearest-neighbour
        search on :math:`x / \ell` when the kernel is RBF/Matérn with (ARD) lengthscales
        :math:`\ell`, so that "nearest" means nearest in the kernel's metric; ``"euclidean"`` uses
        the raw inputs, as the paper does. Other kernels always use the raw inputs.
    :param require_trained: refuse a teacher whose raw hyperparameters are all still 0.
    :param process_group: a ``torch.distributed.ProcessGroup`` whose ranks share the passes
        over :math:`K_{XX}` (``torch.distributed.group.WORLD`` for the default group of
        ``torch.distributed.init_process_group``); ``None`` (the default) computes everything in
        this process, even where a default group is initialised. With a group, every rank builds
        the distiller from the same data, kernel and settings and calls the same methods with the
        same arguments (as under ``torchrun``); see *Across processes* above.

    :ivar covar_module: a frozen copy of the teacher's kernel.
    :ivar frobenius_errors: :math:`\|K_{XX} - W K_{UU} W^\top\|_F` of the last :meth:`fit`,
        indexed by iteration (see :meth:`fit`).
    :ivar student: the :class:`~gpsd.SparseLowRankStudent` of the last :meth:`fit` (reading it
        before :meth:`fit` raises :class:`~gpsd.NotFittedError`).
    """

    def __init__(
        self,
        teacher: ExactGP,
        *,
        num_inducing: int,
        sparsity: int,
        max_iter: int = 0,
        lr: float | None = None,
        optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
        descent: str | None = None,
        inducing_points: Tensor | None = None,
        kmeans_max_iter: int = 50,
        seed: int = 0,
        chunk_size: int | None = None,
        jitter: float | None = None,
        neighbour_metric: str = "lengthscale",
        require_trained: bool = True,
        process_group: object = None,
    ) -> None:
        if process_group is not None:
            check_group(process_group)
        covar_module, train_x, train_y, noise, mean_constant = self._unpack_teacher(
            teacher, require_trained
        )
        self._setup(
            covar_module, train_x, train_y, noise, mean_constant, num_inducing, sparsity,
            max_iter, lr, optimizer, descent, inducing_points, kmeans_max_iter, seed, chunk_size,
            jitter, neighbour_metric, process_group,
        )  # fmt: skip
        if not _forward_matches_modules(
            teacher, self.covar_module, self.mean_constant, self.train_x
        ):
            warn(
                "teacher.forward differs from MultivariateNormal(mean_module(x), "
                "covar_module(x)) on the teacher's training inputs (it transforms the inputs, "
                "say): kernel distillation distils covar_module and mean_module applied to the "
                "raw inputs, so the student will not reproduce this teacher; to distil a kernel of "
                "transformed inputs, pass them to KernelDistillation.from_data (and transform "
                "test inputs alike)",
                UserWarning,
            )

    @classmethod
    def from_data(
        cls,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: gpytorch.kernels.Kernel,
        *,
        noise: float | Tensor,
        num_inducing: int,
        sparsity: int,
        mean_module: gpytorch.means.Mean | None = None,
        max_iter: int = 0,
        lr: float | None = None,
        optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
        descent: str | None = None,
        inducing_points: Tensor | None = None,
        kmeans_max_iter: int = 50,
        seed: int = 0,
        chunk_size: int | None = None,
        jitter: float | None = None,
        neighbour_metric: str = "lengthscale",
        process_group: object = None,
    ) -> KernelDistillation:
        r"""Distil the GP given by its training data, kernel and noise variance (no teacher model).

        :param train_x: training inputs, shape ``(n, d)`` or ``(n,)``.
        :param train_y: training targets, shape ``(n,)``.
        :param covar_module: the GP's (trained) kernel, without batch shape; copied.
        :param noise: the observation noise variance :math:`\sigma^2`, one positive value.
        :param mean_module: ``None`` or a ``ZeroMean`` (prior mean 0) or a ``ConstantMean``.

        The other arguments are the constructor's.
        """
        obj = cls.__new__(cls)
        if process_group is not None:
            check_group(process_group)
        if not isinstance(covar_module, gpytorch.kernels.Kernel):
            raise TypeError(
                f"covar_module must be a gpytorch.kernels.Kernel, got {type(covar_module)}"
            )
        x = check_matrix(as_float_tensor(train_x, "train_x"), "train_x")
        if x.dim() == 1:
            x = x.unsqueeze(-1)
        y = as_float_tensor(train_y, "train_y", dtype=x.dtype, device=x.device)
        noise_t = as_float_tensor(noise, "noise", dtype=x.dtype, device=x.device).reshape(-1)
        mean_constant = _mean_constant(mean_module, "mean_module")
        obj._setup(
            covar_module, x, y, noise_t, mean_constant, num_inducing, sparsity, max_iter, lr,
            optimizer, descent, inducing_points, kmeans_max_iter, seed, chunk_size, jitter,
            neighbour_metric, process_group,
        )  # fmt: skip
        return obj

    @classmethod
    def from_sgpr(
        cls,
        model: ExactGP,
        *,
        sparsity: int,
        max_iter: int = 0,
        lr: float | None = None,
        optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
        descent: str | None = None,
        chunk_size: int | None = None,
        jitter: float | None = None,
        neighbour_metric: str = "lengthscale",
        require_trained: bool = True,
        process_group: object = None,
    ) -> KernelDistillation:
        r"""Distil the exact GP of a trained sparse GP (SGPR) at the SGPR's inducing points.

        ``model`` is a GPyTorch SGPR: an ``ExactGP`` whose ``covar_module`` is a
        ``gpytorch.kernels.InducingPointKernel`` with base kernel :math:`k_\theta` and inducing
        points :math:`U` (shape ``(m, d)``), trained by Titsias' collapsed bound. The teacher
        distilled is the exact GP with the SGPR's hyperparameters: kernel :math:`k_\theta`
        (a frozen copy of ``model.covar_module.base_kernel``), noise ``model.likelihood.noise``
        and ``model.mean_module``, conditioned on the SGPR's training data; its kernel matrix is
        approximated as

        .. math::
            \mathbf K_{XX} \approx \mathbf W\, k_\theta(U, U)\, \mathbf W^\top,

        with :math:`U` the SGPR's inducing points (``num_inducing`` = :math:`m`, no K-means).
        Hyperparameters fitted by the bound suit :math:`m` inducing points: at small :math:`m`
        this student predicts markedly better than the exact GP's own at K-means points
        (deliveries, n = 2,000, m = 100, b = 20: test SMSE 0.189 against 0.253); near
        :math:`m = n` the exact GP's kernel does as well or better
        (``benchmarks/results/kernel_distillation_frontier_cpu.md``).

        Usage::

            sgpr = ...  # an ExactGP with covar_module = InducingPointKernel(base, U, likelihood)
            distiller = KernelDistillation.from_sgpr(sgpr, sparsity=20).fit()

        :param model: the trained SGPR: an ``ExactGP`` with a ``GaussianLikelihood``, a
            ``ZeroMean`` or ``ConstantMean``, no batch shape, and an ``InducingPointKernel`` as
            ``covar_module``. As for a teacher, the constructor's check applies: ``forward``
            should be ``MultivariateNormal(mean_module(x), covar_module(x))`` (a warning
            otherwise).
        :param sparsity: ``b <= m``, non-zeros per row of :math:`W`.
        :param require_trained: refuse a model whose raw hyperparameters are all still 0.

        The other arguments are the constructor's.
        """
        obj = cls.__new__(cls)
        if process_group is not None:
            check_group(process_group)
        if not isinstance(model, ExactGP):
            raise TypeError(
                "model must be a trained GPyTorch SGPR (a gpytorch.models.ExactGP whose "
                f"covar_module is an InducingPointKernel), got {type(model).__name__}"
            )
        inducing_kernel = getattr(model, "covar_module", None)
        if not isinstance(inducing_kernel, gpytorch.kernels.InducingPointKernel):
            raise TypeError(
                "model.covar_module must be a gpytorch.kernels.InducingPointKernel (an SGPR), "
                f"got {type(inducing_kernel).__name__}; distil an exact GP with "
                "KernelDistillation(teacher, ...) instead"
            )
        _, train_x, train_y, noise, mean_constant = cls._unpack_teacher(model, require_trained)
        u = inducing_kernel.inducing_points.detach()
        if u.dim() != 2 or u.shape[-1] != train_x.shape[-1]:
            raise ValueError(
                "model.covar_module.inducing_points must have shape (m, "
                f"d={train_x.shape[-1]}) like the training inputs, got {tuple(u.shape)}"
            )
        obj._setup(
            inducing_kernel.base_kernel, train_x, train_y, noise, mean_constant, u.shape[0],
            sparsity, max_iter, lr, optimizer, descent, u, 0, 0, chunk_size, jitter,
            neighbour_metric, process_group,
        )  # fmt: skip
        if not _forward_matches_modules(
            model, frozen_copy(inducing_kernel), obj.mean_constant, obj.train_x
        ):
            warn(
                "model.forward differs from MultivariateNormal(mean_module(x), covar_module(x)) "
                "on the model's training inputs (it transforms the inputs, say): the distillation "
                "uses covar_module.base_kernel and mean_module applied to the raw inputs, so "
                "the student will not reproduce this model",
                UserWarning,
            )
        return obj

    @staticmethod
    def _unpack_teacher(teacher: ExactGP, require_trained: bool):
        x, y = validate_teacher(
            teacher,
            GaussianLikelihood,
            "a gpytorch.likelihoods.GaussianLikelihood (kernel distillation needs one "
            "homoscedastic Gaussian noise variance)",
            batch=False,
            needs_mean=False,
        )
        if require_trained:
            raw = [p for n, p in teacher.named_parameters() if "raw_" in n or "constant" in n]
            if raw and all(bool((p == 0).all()) for p in raw):
                raise TeacherError(
                    "teacher looks untrained: every raw hyperparameter is still at GPyTorch's "
                    "initial value 0; train it first (or pass require_trained=False)"
                )
        mean = teacher.mean_module if hasattr(teacher, "mean_module") else None
        mean_constant = _mean_constant(mean, "teacher.mean_module")
        noise = teacher.likelihood.noise.detach().reshape(-1)
        return teacher.covar_module, x, y, noise, mean_constant

    def _setup(
        self, covar_module, train_x, train_y, noise, mean_constant, num_inducing, sparsity,
        max_iter, lr, optimizer, descent, inducing_points, kmeans_max_iter, seed, chunk_size,
        jitter, neighbour_metric, process_group=None,
    ) -> None:  # fmt: skip
        # the distillation and its student are no functions of these: keep no autograd graph
        # (a noise such as likelihood.noise would otherwise leave the student's buffers attached
        # to it, and the student could not be deep-copied)
        x = check_matrix(train_x.detach(), "train_x")
        if x.dim() != 2:
            raise ValueError(f"train_x must have shape (n, d), got {tuple(x.shape)}")
        if covar_module.batch_shape != torch.Size():
            raise ValueError(
                "covar_module must have no batch shape (the student distils one kernel), got "
                f"batch shape {tuple(covar_module.batch_shape)}"
            )
        # a frozen copy, like the noise and the mean: K_UU, the neighbour metric and the student
        # describe the kernel as given, even if the teacher goes on training before fit()
        covar_module = frozen_copy(covar_module)
        n = x.shape[0]
        if train_y.dim() != 1:
            raise ValueError(f"train_y must have shape (n={n},), got {tuple(train_y.shape)}")
        y = check_vector(train_y.detach().to(x), "train_y", n)
        noise = noise.detach()
        if noise.numel() != 1 or not bool(noise > 0) or not bool(torch.isfinite(noise).all()):
            raise ValueError(f"noise must be one positive finite variance, got {noise.tolist()}")
        num_inducing = check_int(num_inducing, "num_inducing")
        sparsity = check_int(sparsity, "sparsity")
        if num_inducing > n:
            raise ValueError(
                f"num_inducing (m={num_inducing}) must not exceed n={n} training inputs"
            )
        if sparsity > num_inducing:
            raise ValueError(
                f"sparsity (b={sparsity}) must not exceed num_inducing (m={num_inducing})"
            )
        max_iter = check_int(max_iter, "max_iter", minimum=0)
        kmeans_max_iter = check_int(kmeans_max_iter, "kmeans_max_iter", minimum=0)
        chunk_size = check_int(chunk_size, "chunk_size", optional=True)
        seed = check_int(seed, "seed", minimum=0)
        if lr is not None:
            lr = check_positive_float(lr, "lr")
        if lr is not None and optimizer is not None:
            raise ValueError("give either lr or optimizer, not both")
        if jitter is not None:
            jitter = check_positive_float(jitter, "jitter", allow_zero=True)
        if optimizer is not None and not callable(optimizer):
            raise TypeError(f"optimizer must be callable or None, got {type(optimizer).__name__}")
        if descent not in (None, "block", "gradient"):
            raise ValueError(f"descent must be None, 'block' or 'gradient', got {descent!r}")
        if descent == "block" and (lr is not None or optimizer is not None):
            raise ValueError(
                "descent='block' takes the exact line search: give no lr or optimizer with it "
                "(or descent='gradient')"
            )
        if descent is None:
            descent = "gradient" if lr is not None or optimizer is not None else "block"
        if inducing_points is not None:
            u = check_matrix(
                as_float_tensor(inducing_points, "inducing_points", dtype=x.dtype).detach(),
                "inducing_points",
            )
            check_same_device(x, u, "inducing_points", "train_x")
            if u.shape != (num_inducing, x.shape[-1]):
                raise ValueError(
                    f"inducing_points must have shape (num_inducing={num_inducing}, "
                    f"d={x.shape[-1]}), "
                    f"got {tuple(u.shape)}"
                )
            inducing_points = u.clone()  # a copy: the caller's tensor is no state of this object
        for p in covar_module.parameters():
            check_same_device(x, p, "covar_module's parameters", "train_x")
        if neighbour_metric not in ("lengthscale", "euclidean"):
            raise ValueError(
                f"neighbour_metric must be 'lengthscale' or 'euclidean', got {neighbour_metric!r}"
            )
        scale = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        params = stationary_kernel_parameters(covar_module)
        if params is not None:
            check_lengthscale_count(params[1], x.shape[-1], "train_x")
        if neighbour_metric == "lengthscale" and params is not None:
            scale = (scale * params[1].to(scale)).contiguous()
        self.neighbour_scale = scale  # shape: (d,)
        self.covar_module = covar_module
        self.train_x, self.train_y = x, y
        self.noise = noise.to(x, copy=True).reshape(())
        self.mean_constant = float(mean_constant)
        self.num_inducing, self.sparsity, self.max_iter = num_inducing, sparsity, max_iter
        self.lr, self.optimizer, self.descent = lr, optimizer, descent
        self.kmeans_max_iter, self.seed = kmeans_max_iter, seed
        self.chunk_size = chunk_size or max(1, _CHUNK_ELEMENTS // max(n, num_inducing * sparsity))
        self.jitter = jitter
        self.inducing_points: Tensor | None = inducing_points
        self.neighbour_indices: Tensor | None = None
        self.weight_values: Tensor | None = None
        self.initial_weight_values: Tensor | None = None
        self.inducing_covariance: Tensor | None = None
        self.frobenius_errors: list[float] = []
        self.timings: dict[str, float] = {}
        self._student: SparseLowRankStudent | None = None
        #: The ``torch.distributed.ProcessGroup`` whose ranks share the passes over
        #: :math:`K_{XX}` (``None``: this process alone).
        self.process_group = process_group
        #: The columns of :math:`K_{XX}` (and rows of :math:`W`) this rank evaluates, and the
        #: number of them every rank holds, in rank order.
        self._block, self._block_sizes = slice(0, n), [n]
        if process_group is not None:
            rank, size = check_group(process_group)
            self._block_sizes = split_sizes(n, size)
            start = sum(self._block_sizes[:rank])
            self._block = slice(start, start + self._block_sizes[rank])
            self._check_same_problem()

    def _check_same_problem(self) -> None:
        """The same ``ValueError`` on every rank of :attr:`process_group` unless all hold the
        same problem: data, noise, mean, kernel and settings (collective)."""
        inducing = self.inducing_points
        settings = (
            self.num_inducing, self.sparsity, self.max_iter, self.lr, self.optimizer is None,
            self.descent, self.kmeans_max_iter, self.seed, self.chunk_size, self.jitter,
            self.neighbour_scale.tolist(),
        )  # fmt: skip
        check_same(
            {
                **tensor_fingerprint("train_x", self.train_x),
                **tensor_fingerprint("train_y", self.train_y),
                **tensor_fingerprint("noise", self.noise),
                **tensor_fingerprint(
                    "mean constant", torch.tensor([self.mean_constant], dtype=torch.float64)
                ),
                **module_fingerprint(self.covar_module),
                **tensor_fingerprint(
                    "inducing_points", inducing if inducing is not None else self.train_x[:0]
                ),
                "settings": torch.tensor([text_checksum(repr(settings))]),
            },
            self.process_group,
            "KernelDistillation's check of its problem",
            "every rank must build it from the same training data, noise, mean and kernel "
            "(hyperparameters and dtype), with the same settings (num_inducing, sparsity, "
            "max_iter, lr, descent, seed, chunk_size, ...)",
        )

    @property
    def student(self) -> SparseLowRankStudent:
        """The :class:`~gpsd.SparseLowRankStudent` of the last :meth:`fit`.

        :raises NotFittedError: before the first :meth:`fit`.
        """
        if self._student is None:
            raise NotFittedError(
                "this KernelDistillation has no student yet: call fit() first "
                "(distiller = KernelDistillation(teacher, ...).fit(); distiller.student)"
            )
        return self._student

    # ------------------------------------------------------------------ building blocks
    def prepare(self, *, progress: object = False, callback: Callback | None = None) -> None:
        """K-means (unless ``inducing_points`` was given), neighbours, :math:`K_{UU}`, initial W
        (collective with a :attr:`process_group`: see :meth:`least_squares_weights`).

        Each phase reports its iterations as a phase of task ``"KernelDistillation.prepare"``
        (see :meth:`fit`, which runs it where it has not run).

        :param progress: ``False``, ``True`` (a ``tqdm`` bar per phase) or a ``tqdm`` bar to
            advance.
        :param callback: called after every iteration of a phase with an
            :class:`~gpsd.IterationRecord` naming the phase; returning ``True`` ends the K-means
            iterations with the centroids reached, and the later phases, which need every row,
            run whole without calling it again.
        """
        check_progress(progress, callback)
        self._prepare("KernelDistillation.prepare", progress, callback)

    def _prepare(self, task: str, progress: object, callback: Callback | None) -> bool:
        """:meth:`prepare`, reported as phases of ``task``; whether the callback asked to
        stop."""
        t0 = time.perf_counter()
        x = self.train_x
        scale = self.neighbour_scale
        stopped = False
        if self.inducing_points is None:
            with ProgressReporter(
                task, self.kmeans_max_iter, progress, callback, phase="k-means"
            ) as report:
                centres = kmeans(
                    x / scale,
                    self.num_inducing,
                    max_iter=self.kmeans_max_iter,
                    seed=self.seed,
                    callback=lambda r: report.update(r.iteration, loss=r.loss, **r.info),
                )
            stopped = report.stopped
            if stopped:  # the later phases run whole, without further records
                callback = None
            if self.process_group is not None:
                # on GPUs, K-means adds with atomics whose order varies: rank 0's for all
                what = "all_gather of the K-means centroids"
                centres = all_gather(centres, self.process_group, what)[0]
            self.inducing_points = centres * scale
        t1 = time.perf_counter()
        with ProgressReporter(task, 1, progress, callback, phase="neighbours") as report:
            _, idx = nearest_inducing_points(x / scale, self.inducing_points / scale, self.sparsity)
            report.update(1)
        if report.stopped:
            stopped, callback = True, None
        self.neighbour_indices = idx.sort(dim=-1).values  # shape: (n, b)
        self._pattern = _SparseRows(self.neighbour_indices, self.num_inducing)
        self.inducing_covariance = evaluate_kernel(
            self.covar_module, self.inducing_points, self.inducing_points
        )
        blocks = len(self._least_squares_blocks())
        with ProgressReporter(task, blocks, progress, callback, phase="least squares") as report:
            self.initial_weight_values = self._least_squares_weights(report)
        stopped = stopped or report.stopped
        self.weight_values = self.initial_weight_values.clone()
        t2 = time.perf_counter()
        self.timings.update(kmeans=t1 - t0, initialisation=t2 - t1)
        return stopped

    def _least_squares_blocks(self) -> list[slice]:
        """The blocks of this rank's rows that :meth:`least_squares_weights` solves at once."""
        rows = max(1, _CHUNK_ELEMENTS // (self.num_inducing * self.sparsity))
        block = self._block  # all n rows without a process group
        return [
            slice(start, min(start + rows, block.stop))
            for start in range(block.start, block.stop, rows)
        ]

    def least_squares_weights(self) -> Tensor:
        r"""Initial W, rows :math:`\arg\min_\beta \|\beta K_{UU}(J_i,:) - k(x_i, U)\|_2` (n, b).

        Solved as a batch of ``m x b`` least-squares problems (normal equations with iterative
        refinement, SVD for rows where it does not converge), in chunks of rows, in float64
        whatever the dtype (except on MPS, which has none): the normal equations square the
        condition number of :math:`K_{UU}(J_i,:)`, which at lengthscales long next to the spacing
        of the inducing points reaches :math:`10^6`, beyond what float32 can factorise. Every
        row's Gram matrix :math:`K_{UU}(J_i,:) K_{UU}(J_i,:)^\top` is read from
        :math:`K_{UU} K_{UU}^\top`, computed once. With a :attr:`process_group`, collective:
        each rank solves its block of rows, and the rows are gathered.
        """
        return self._least_squares_weights()

    def _least_squares_weights(self, report: ProgressReporter | None = None) -> Tensor:
        """:meth:`least_squares_weights`, reporting each block of rows solved to ``report``."""
        idx, b = self.neighbour_indices, self.sparsity
        dtype = self.inducing_covariance.dtype
        work = dtype if self.inducing_covariance.device.type == "mps" else torch.float64
        kuu = self.inducing_covariance.to(work)
        kuu_gram = kuu @ kuu.mT  # shape: (m, m)
        out = []
        for number, rows in enumerate(self._least_squares_blocks(), start=1):
            xr = self.train_x[rows]
            rhs = evaluate_kernel(self.covar_module, xr, self.inducing_points).to(work)  # (c, m)
            j = idx[rows]  # shape: (c, b)
            design = kuu[j]  # K_UU(J_i, :), shape: (c, b, m)
            gram = kuu_gram[j.unsqueeze(-1), j.unsqueeze(-2)]  # shape: (c, b, b)
            out.append(_batched_least_squares(design, rhs, gram).to(dtype))
            if report is not None:
                report.update(number, rows=rows.stop - rows.start)
        mine = torch.cat(out) if out else kuu.new_zeros(0, b).to(dtype)  # (n_p, b)
        return self._gather_rows(mine, "all_gather of the least-squares start")

    def _gather_rows(self, mine: Tensor, what: str) -> Tensor:
        """This rank's rows :attr:`_block` of an ``(n, b)`` matrix, with every other rank's,
        ``(n, b)`` on every rank (``mine`` itself without a process group)."""
        if self.process_group is None:
            return mine
        return all_gather_cat(mine, 0, self._block_sizes, self.process_group, what)

    def _sum_over_ranks(self, mine: Tensor, what: str) -> Tensor:
        """This rank's partial sums plus every other rank's (``mine`` itself without a
        process group)."""
        if self.process_group is None:
            return mine
        return all_reduce_sum(mine, self.process_group, what)

    def _columns(self, start: int) -> tuple[slice, Tensor]:
        """Columns ``start ..`` of :math:`K_{XX}`, at most ``chunk_size`` of them and none
        beyond this rank's block :attr:`_block`."""
        cols = slice(start, min(start + self.chunk_size, self._block.stop))
        return cols, evaluate_kernel(self.covar_module, self.train_x, self.train_x[cols])  # (n, c)

    def _times_kuu(self, values: Tensor, cols: slice) -> Tensor:
        """Rows ``cols`` of :math:`W K_{UU}`, shape ``(c, m)``."""
        return self._pattern.rows(values, cols) @ self.inducing_covariance

    def objective_and_gradient(
        self, values: Tensor, *, gradient: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        r"""Squared error :math:`\|K_{XX} - W K_{UU} W^\top\|_F^2` and its gradient on the pattern.

        With a :attr:`process_group`, collective: each rank evaluates its block of columns, the
        objective is summed over the ranks and the gradient's rows are gathered.

        :param values: non-zeros of :math:`W`, shape ``(n, b)``.
        :param gradient: also return the gradient (``False``: the objective alone, cheaper).
        :return: ``(objective (), gradient (n, b) or None)``.
        """
        w = self._pattern.matrix(values)
        wt = self._pattern.transpose(values) if gradient else None
        total = values.new_zeros(())
        block = self._block  # all n columns without a process group
        rows = slice(0, block.stop - block.start)
        grad = torch.empty_like(values[rows]) if gradient else None  # rows of this block
        with torch.no_grad():
            for start in range(block.start, block.stop, self.chunk_size):
                cols, k_cols = self._columns(start)
                a_rows = self._times_kuu(values, cols)  # (W K_UU)[cols], shape: (c, m)
                resid = w @ a_rows.transpose(-1, -2) - k_cols  # E[:, cols] (n, c)
                total = total + resid.pow(2).sum()
                if gradient:
                    ew = (wt @ resid).transpose(-1, -2)  # (E W)[cols], shape: (c, m)
                    # (E W K_UU)[cols] on the pattern, shape: (c, b)
                    ewk = ew @ self.inducing_covariance.mT
                    local = slice(cols.start - block.start, cols.stop - block.start)
                    grad[local] = 4.0 * ewk.gather(-1, self.neighbour_indices[cols])
        total = self._sum_over_ranks(total, "all_reduce of the objective")
        if gradient:
            grad = self._gather_rows(grad, "all_gather of the gradient")
        return total, grad

    def frobenius_error(self, values: Tensor | None = None) -> float:
        r""":math:`\|K_{XX} - W K_{UU} W^\top\|_F` (chunked), at ``values`` or the current ``W``
        (collective with a :attr:`process_group`)."""
        if self.weight_values is None:
            self.prepare()
        values = self.weight_values if values is None else values
        return float(self.objective_and_gradient(values, gradient=False)[0].sqrt())

    def block_direction(self, values: Tensor, gradient: Tensor) -> Tensor:
        r"""The block least-squares direction :math:`D` (``W - D`` is one alternating step).

        With the right factor :math:`A = K_{UU} W^\top` held fixed, the objective is a convex
        quadratic in the left factor's rows, and row :math:`i` is minimised by

        .. math::
            \beta_i = \arg\min_{\beta} \|K_{XX}(i, :) - \beta\, A(J_i, :)\|_2
                     = w_i - G(J_i, J_i)^{-1} \tfrac14 \nabla_{W}(i, J_i), \qquad
            G = A A^\top = K_{UU} W^\top W K_{UU},

        because the gradient of the symmetric objective is twice that of the left factor
        (:math:`2 E A^\top`, Hessian :math:`2 G(J_i, J_i)` per row). The direction
        :math:`D_i = G(J_i, J_i)^{-1} \nabla_W(i, J_i) / 4` is the gradient preconditioned by
        the block-diagonal of the left factor's Hessian (a Gauss-Newton block step); it is a
        descent direction of the symmetric objective (:math:`\langle \nabla_W, D\rangle > 0`),
        and :meth:`fit` searches along it exactly. :math:`G` costs :math:`O(n b^2 + m^3)`, the
        ``n`` solves :math:`O(n b^3)`, in float64 (except on MPS), with a relative jitter of
        :math:`10^{-12}` on each :math:`G(J_i, J_i)`; rows whose factorisation still fails take
        the pseudo-inverse. With a :attr:`process_group`, collective: :math:`G` is computed on
        every rank, the solves of each rank's rows only, and the rows are gathered.

        :param values: non-zeros of :math:`W`, shape ``(n, b)``.
        :param gradient: :math:`\nabla_W` on the pattern (:meth:`objective_and_gradient`),
            shape ``(n, b)``.
        :return: :math:`D`, shape ``(n, b)``.
        """
        if self.neighbour_indices is None:
            self.prepare()
        idx, m = self.neighbour_indices, self.num_inducing
        for name, tensor in (("values", values), ("gradient", gradient)):
            if not isinstance(tensor, Tensor) or tensor.shape != idx.shape:
                shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
                raise ValueError(
                    f"{name} must be a tensor of shape {tuple(idx.shape)}, got {shape}"
                )
        dtype = values.dtype
        work = dtype if values.device.type == "mps" else torch.float64
        vals = values.to(work)
        outer = vals.unsqueeze(-1) * vals.unsqueeze(-2)  # shape: (n, b, b)
        flat = (idx.unsqueeze(-1) * m + idx.unsqueeze(-2)).reshape(-1)
        gram = torch.zeros(m * m, dtype=work, device=values.device)
        gram = gram.index_add_(0, flat, outer.reshape(-1)).reshape(m, m)  # W^T W
        kuu = self.inducing_covariance.to(work)
        g = kuu @ gram @ kuu  # shape: (m, m)
        g = 0.5 * (g + g.mT)
        b = self.sparsity
        eye = torch.eye(b, dtype=work, device=values.device)
        rows = max(1, _CHUNK_ELEMENTS // (b * b))
        owned = self._block  # all n rows without a process group
        out = []
        for start in range(owned.start, owned.stop, rows):
            stop = min(start + rows, owned.stop)
            j = idx[start:stop]  # shape: (c, b)
            block = g[j.unsqueeze(-1), j.unsqueeze(-2)]  # shape: (c, b, b)
            scale = block.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(work).tiny)
            block = block + 1e-12 * scale[:, None, None] * eye
            rhs = 0.25 * gradient[start:stop].to(work).unsqueeze(-1)  # (c, b, 1)
            chol, info = torch.linalg.cholesky_ex(block)
            sol = torch.cholesky_solve(rhs, chol)
            bad = (info != 0) | ~torch.isfinite(sol).all(dim=(-2, -1))
            if bool(bad.any()):
                sol[bad] = torch.linalg.pinv(block[bad], hermitian=True) @ rhs[bad]
            out.append(sol.squeeze(-1))
        mine = torch.cat(out) if out else g.new_zeros(0, b)  # shape: (n_p, b)
        return self._gather_rows(mine.to(dtype), "all_gather of the block direction")

    def _line_search(self, values: Tensor, direction: Tensor) -> tuple[float, float]:
        """The first local minimiser ``t >= 0`` of ``f(values - t * direction)`` and ``f`` there.

        Not the global minimiser of the quartic: the objective is even in ``W``, so a farther
        minimum can be (nearly) ``-W``, beyond the barrier at ``W = 0``, whose student predicts
        the negated mean (every input equal, say, where the fit is exact).
        """
        w = self._pattern.matrix(values)
        dmat = self._pattern.matrix(direction)
        c = torch.zeros(6, dtype=values.dtype, device=values.device)
        block = self._block  # all n columns without a process group
        with torch.no_grad():
            for start in range(block.start, block.stop, self.chunk_size):
                cols, k_cols = self._columns(start)
                a = self._times_kuu(values, cols).transpose(-1, -2)  # (m, c)
                bmat = self._times_kuu(direction, cols).transpose(-1, -2)
                both = torch.cat([a, bmat], dim=-1)  # shape: (m, 2c)
                w_both, d_both = w @ both, dmat @ both
                width = a.shape[-1]
                e0 = w_both[:, :width] - k_cols  # E_0[:, cols]
                s = d_both[:, :width] + w_both[:, width:]  # (D K W^T + W K D^T)[:, cols]
                q = d_both[:, width:]  # (D K D^T)[:, cols]
                c += torch.stack(
                    [
                        (e0 * e0).sum(),
                        (e0 * s).sum(),
                        (s * s).sum(),
                        (e0 * q).sum(),
                        (s * q).sum(),
                        (q * q).sum(),
                    ]
                )
        c = self._sum_over_ranks(c, "all_reduce of the line search's coefficients")
        ee, es, ss, eq, sq, qq = c.tolist()
        # f(t) = ee - 2 es t + (ss + 2 eq) t^2 - 2 sq t^3 + qq t^4
        coeffs = [qq, -2.0 * sq, ss + 2.0 * eq, -2.0 * es, ee]
        poly = np.polynomial.Polynomial(coeffs[::-1])
        # f decreases from t = 0 (a descent direction) up to its first critical point
        t = min(
            (
                r.real
                for r in poly.deriv().roots()
                if abs(r.imag) < 1e-12 * (1 + abs(r)) and r.real > 0
            ),
            default=0.0,
        )
        if poly(t) > ee:  # not a descent direction, or no step beyond rounding
            t = 0.0
        return t, max(poly(t), 0.0)

    def fit(
        self, *, progress: object = False, callback: Callback | None = None
    ) -> KernelDistillation:
        r"""Take up to ``max_iter`` descent iterations from the current :math:`W`, build the
        student (:attr:`student`) and return this distiller.

        :attr:`frobenius_errors` holds :math:`\|K_{XX} - W K_{UU} W^\top\|_F` indexed by
        iteration: entry 0 is the error of the start, entry ``k`` the error after iteration
        ``k``; ``max_iter + 1`` entries, or ``k + 1`` when the callback stops the descent after
        iteration ``k`` (the student is then built from the :math:`W` reached there).

        The first call starts from the least-squares :math:`W` (running :meth:`prepare` if it has
        not run). A further call continues from where the last one stopped (an ``optimizer`` starts
        afresh, without its earlier state), and :attr:`frobenius_errors` then describes the new
        iterations only. To start over from the least-squares :math:`W` instead, set
        ``weight_values = initial_weight_values.clone()`` first.

        Every phase reports its iterations, each record naming its ``phase``: where
        :meth:`prepare` runs, ``"k-means"`` (one per Lloyd iteration, ``loss`` the mean squared
        distance to the assigned centroid), ``"neighbours"`` (one, after the search) and
        ``"least squares"`` (one per block of rows solved, ``info["rows"]`` its rows); then
        ``"descent"``.

        :param progress: ``False``, ``True`` (a ``tqdm`` bar per phase) or a ``tqdm`` bar to
            advance.
        :param callback: called after every iteration with an :class:`~gpsd.IterationRecord` of
            task ``"KernelDistillation.fit"``; in the ``"descent"`` phase, after iteration ``k``
            with ``iteration`` ``k`` and ``loss`` the error after it (``frobenius_errors[k]``).
            Returning ``True`` stops the descent; in the preparation, it ends the K-means
            iterations with the centroids reached, and the descent takes no iteration (the
            student is built from the least-squares :math:`W`).
        :return: this distiller.
        """
        check_progress(progress, callback)
        prepared_stop = False
        if self.weight_values is None:
            prepared_stop = self._prepare("KernelDistillation.fit", progress, callback)
        max_iter = 0 if prepared_stop else self.max_iter
        t0 = time.perf_counter()
        values = self.weight_values
        errors: list[float] = []
        opt = None
        if self.optimizer is not None:
            param = torch.nn.Parameter(values.clone())
            opt = self.optimizer([param])
        with ProgressReporter(
            "KernelDistillation.fit", max_iter, progress, callback, phase="descent"
        ) as report:
            stopped = False
            for step in range(max_iter):
                current = param.detach() if opt is not None else values
                obj, grad = self.objective_and_gradient(current)
                errors.append(float(obj.sqrt()))
                # the error after iteration `step` is known now, with the gradient there
                if step > 0 and report.update(step, loss=errors[-1]):
                    stopped = True
                    break
                if opt is not None:
                    opt.zero_grad()
                    param.grad = grad
                    opt.step()
                    values = param.detach().clone()
                elif self.lr is not None:
                    values = values - self.lr * grad
                else:
                    direction = (
                        self.block_direction(values, grad) if self.descent == "block" else grad
                    )
                    t, _ = self._line_search(values, direction)
                    values = values - t * direction
                if not bool(torch.isfinite(values).all()):
                    advice = (
                        "the exact line search took a non-finite step (an ill-conditioned "
                        "K_UU: use float64, or fewer or more spread-out inducing points)"
                        if self._uses_line_search
                        else f"{self._step_rule()} is too large; lower it, or use the exact line "
                        "search (lr=None, the default)"
                    )
                    raise RuntimeError(
                        f"kernel distillation diverged at iteration {step + 1}: {advice}"
                    )
            if not stopped:
                errors.append(self.frobenius_error(values))
                if max_iter > 0:
                    report.update(max_iter, loss=errors[-1])
        self.weight_values = values
        self.frobenius_errors = errors
        # the exact line search never raises the error (beyond rounding); fixed steps can
        grew = not self._uses_line_search and errors[-1] > 1.001 * errors[0]
        if grew:
            warn(
                f"kernel distillation ended with a larger error ||K - WKW^T||_F = {errors[-1]:.3e} "
                f"than it started with ({errors[0]:.3e}): {self._step_rule()} is too large; "
                "lower it, or use the exact line search (lr=None, the default)",
                RuntimeWarning,
            )
        t1 = time.perf_counter()
        try:
            self._student = SparseLowRankStudent.from_sparse_weights(
                self.covar_module,
                self.inducing_points,
                values,
                self.neighbour_indices,
                self.train_y,
                self.noise,
                mean_constant=self.mean_constant,
                inducing_covariance=self.inducing_covariance,
                jitter=self.jitter,
                neighbour_scale=self.neighbour_scale,
            )
        except RuntimeError as err:
            if not grew:
                raise
            raise RuntimeError(
                f"kernel distillation diverged (||K - WKW^T||_F grew from {errors[0]:.3e} to "
                f"{errors[-1]:.3e}), and the student cannot be built from its weights: "
                f"{self._step_rule()} is too large; lower it, or use the exact line search "
                "(lr=None, the default)"
            ) from err
        self.timings.update(optimisation=t1 - t0, student=time.perf_counter() - t1)
        return self

    @property
    def _uses_line_search(self) -> bool:
        """Whether the steps come from the exact line search (no fixed step, no optimiser)."""
        return self.lr is None and self.optimizer is None

    def _step_rule(self) -> str:
        """The fixed-step setting that chose the steps, for messages about them."""
        if self.optimizer is not None:
            return "the optimizer's learning rate"
        return f"lr={self.lr:g}"

    def dense_weights(self, values: Tensor | None = None) -> Tensor:
        """:math:`W` as a dense ``(n, m)`` matrix (for inspection of small problems)."""
        if self.weight_values is None:
            self.prepare()
        return self._pattern.dense(self.weight_values if values is None else values)
