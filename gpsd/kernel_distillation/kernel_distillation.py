"""Kernel distillation (Song & Sun): fit a sparse low-rank ``W K_UU W^T`` to a GP's kernel."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import gpytorch
import numpy as np
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ExactGP
from torch import Tensor

from gpsd._internal.collectives import (
    check_group,
    check_same,
    module_fingerprint,
    tensor_fingerprint,
    text_checksum,
)
from gpsd._internal.module_state import adopt_buffer_shapes
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.stationary_kernel import (
    check_lengthscale_count,
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
from gpsd.kernel_distillation._inducing_selection import select_inducing_points
from gpsd.kernel_distillation._objective import (
    SparseKernelObjective,
    default_chunk_size,
    step_rule,
)
from gpsd.kernel_distillation.sparse_low_rank_student import SparseLowRankStudent
from gpsd.progress import Callback

__all__ = ["KernelDistillation"]

#: Training inputs on which a teacher's ``forward`` is compared with its modules.
_FORWARD_CHECK_POINTS = 8
#: The buffers a distiller learns (``None`` until :meth:`KernelDistillation.prepare`).
_LEARNT_BUFFERS = (
    "inducing_points",
    "neighbour_indices",
    "inducing_covariance",
    "initial_weight_values",
    "weight_values",
)


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


@dataclasses.dataclass(frozen=True)
class _Problem:
    """The GP a distiller distils, checked: a frozen copy of its kernel without batch shape,
    inputs ``(n, d)``, targets ``(n,)``, one positive noise variance (0-d, the inputs' dtype)
    and the constant prior mean; no tensor carries an autograd graph."""

    covar_module: gpytorch.kernels.Kernel
    train_x: Tensor
    train_y: Tensor
    noise: Tensor
    mean_constant: float

    @classmethod
    def checked(
        cls,
        covar_module: gpytorch.kernels.Kernel,
        train_x: Tensor,
        train_y: Tensor,
        noise: Tensor,
        mean_constant: float,
    ) -> _Problem:
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
        n = x.shape[0]
        if train_y.dim() != 1:
            raise ValueError(f"train_y must have shape (n={n},), got {tuple(train_y.shape)}")
        y = check_vector(train_y.detach().to(x), "train_y", n)
        noise = noise.detach()
        if noise.numel() != 1 or not bool(noise > 0) or not bool(torch.isfinite(noise).all()):
            raise ValueError(f"noise must be one positive finite variance, got {noise.tolist()}")
        # a frozen copy, like the noise and the mean: K_UU, the neighbour metric and the student
        # describe the kernel as given, even if the teacher goes on training before fit()
        return cls(
            frozen_copy(covar_module),
            x,
            y,
            noise.to(x, copy=True).reshape(()),
            float(mean_constant),
        )

    @classmethod
    def from_teacher(cls, teacher: ExactGP, require_trained: bool) -> _Problem:
        """The problem of a trained ``ExactGP`` with a ``GaussianLikelihood``."""
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
        covar_module = teacher.covar_module
        noise = teacher.likelihood.noise.detach().reshape(-1)
        return cls.checked(covar_module, x, y, noise, mean_constant)

    @classmethod
    def from_data(
        cls,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: gpytorch.kernels.Kernel,
        noise: float | Tensor,
        mean_module: gpytorch.means.Mean | None,
    ) -> _Problem:
        """The problem given by data, a kernel, a noise variance and a prior mean."""
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
        return cls.checked(covar_module, x, y, noise_t, mean_constant)


def _descent_rule(
    lr: float | None, optimizer: object, descent: str | None
) -> tuple[float | None, str]:
    """``lr`` checked and the descent direction: ``descent``, or by default ``"block"`` with
    the exact line search and ``"gradient"`` with ``lr`` or ``optimizer``."""
    if lr is not None:
        lr = check_positive_float(lr, "lr")
    if lr is not None and optimizer is not None:
        raise ValueError("give either lr or optimizer, not both")
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
    return lr, descent


def _given_inducing_points(inducing_points: object, x: Tensor, num_inducing: int) -> Tensor | None:
    """A copy of the user's inducing points, checked to be ``(num_inducing, d)`` and finite in
    the dtype and on the device of ``x`` (``None`` for K-means)."""
    if inducing_points is None:
        return None
    u = check_matrix(
        as_float_tensor(inducing_points, "inducing_points", dtype=x.dtype).detach(),
        "inducing_points",
    )
    check_same_device(x, u, "inducing_points", "train_x")
    if u.shape != (num_inducing, x.shape[-1]):
        raise ValueError(
            f"inducing_points must have shape (num_inducing={num_inducing}, "
            f"d={x.shape[-1]}), got {tuple(u.shape)}"
        )
    return u.clone()  # a copy: the caller's tensor is no state of the distiller


def _neighbour_scale(covar_module: gpytorch.kernels.Kernel, x: Tensor, metric: str) -> Tensor:
    """The scale :math:`s` of the neighbour metric :math:`x / s`, shape ``(d,)``: the
    (ARD) lengthscales of an RBF or Matérn kernel for ``"lengthscale"``, else ones."""
    if metric not in ("lengthscale", "euclidean"):
        raise ValueError(f"neighbour_metric must be 'lengthscale' or 'euclidean', got {metric!r}")
    scale = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    params = stationary_kernel_parameters(covar_module)
    if params is not None:
        check_lengthscale_count(params[1], x.shape[-1], "train_x")
    if metric == "lengthscale" and params is not None:
        scale = (scale * params[1].to(scale)).contiguous()
    return scale


def _refuse(options: dict[str, Any], names: tuple[str, ...], method: str) -> None:
    """A ``TypeError`` naming the first of ``names`` in ``options``, which ``method`` sets
    itself."""
    for name in names:
        if name in options:
            raise TypeError(f"{method}() got an unexpected keyword argument {name!r}")


def _rebuild_student(module: KernelDistillation, incompatible_keys: object) -> None:
    """After ``load_state_dict``: the student of a loaded fitted distiller, from its buffers."""
    if module._fitted and module._student is None:
        module._set_student(module._build_student())


class KernelDistillation(gpytorch.Module):
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
    rank calls them in the same order with the same arguments (a ``callback`` must stop the
    preparation and the descent on every rank alike). A collective that fails or waits longer
    than the group's ``timeout`` raises a :class:`~gpsd.DistributedError`. Collectives run on the
    tensors' device with NCCL, on the CPU with gloo.

    **Parts.** The distiller composes three pieces: the inducing-point selection (K-means and
    the nearest-inducing neighbourhoods :math:`J_i`), the objective on the pattern they fix (the
    blocks of :math:`K_{XX}`, the least-squares start, the gradient, the block direction, the
    line search, the descent and the sums over ranks), and this estimator, which holds the
    problem, the settings and the result.

    **Saving and moving.** The distiller is a ``gpytorch.Module``. Its data (``train_x``,
    ``train_y``, ``noise``, ``neighbour_scale``), the frozen ``covar_module`` and what it learns
    (``inducing_points``, ``neighbour_indices``, ``inducing_covariance``,
    ``initial_weight_values``, ``weight_values``) are buffers and parameters, and the mean
    constant and ``frobenius_errors`` its extra state: ``state_dict()`` saves them, and
    ``load_state_dict`` into a distiller built alike (the same constructor arguments, fitted or
    not) restores them and rebuilds the student of a fitted one, which then predicts as the
    saved one. ``.to(device, dtype)`` moves and casts all of them, the student included, so a
    distiller moved with ``.to(torch.float32)`` predicts in float32 (and a further :meth:`fit`
    descends in float32).

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
    :ivar inducing_points: :math:`U`, shape ``(m, d)`` (``None`` before :meth:`prepare`, unless
        given).
    :ivar neighbour_indices: :math:`J`, shape ``(n, b)``, sorted within each row.
    :ivar inducing_covariance: :math:`K_{UU}`, shape ``(m, m)``.
    :ivar initial_weight_values: the non-zeros of the least-squares :math:`W`, shape ``(n, b)``.
    :ivar weight_values: the non-zeros of the current :math:`W`, shape ``(n, b)``.
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
        super().__init__()
        if process_group is not None:
            check_group(process_group)
        # from_data and from_sgpr pass the problem they built
        given = isinstance(teacher, _Problem)
        problem = teacher if given else _Problem.from_teacher(teacher, require_trained)
        x = problem.train_x
        n = x.shape[0]
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
        lr, descent = _descent_rule(lr, optimizer, descent)
        if jitter is not None:
            jitter = check_positive_float(jitter, "jitter", allow_zero=True)
        inducing_points = _given_inducing_points(inducing_points, x, num_inducing)
        for p in problem.covar_module.parameters():
            check_same_device(x, p, "covar_module's parameters", "train_x")
        scale = _neighbour_scale(problem.covar_module, x, neighbour_metric)
        self.covar_module = problem.covar_module
        self.register_buffer("train_x", x)  # shape: (n, d)
        self.register_buffer("train_y", problem.train_y)  # shape: (n,)
        self.register_buffer("noise", problem.noise)  # shape: ()
        self.register_buffer("neighbour_scale", scale)  # shape: (d,)
        self.mean_constant = problem.mean_constant
        self.num_inducing, self.sparsity, self.max_iter = num_inducing, sparsity, max_iter
        self.lr, self.optimizer, self.descent = lr, optimizer, descent
        self.kmeans_max_iter, self.seed = kmeans_max_iter, seed
        self.chunk_size = chunk_size or default_chunk_size(n, num_inducing, sparsity)
        self.jitter = jitter
        for name in _LEARNT_BUFFERS:
            self.register_buffer(name, None)
        self.inducing_points = inducing_points
        self.frobenius_errors: list[float] = []
        self.timings: dict[str, float] = {}
        self._student: SparseLowRankStudent | None = None
        self._fitted = False
        #: The ``torch.distributed.ProcessGroup`` whose ranks share the passes over
        #: :math:`K_{XX}` (``None``: this process alone).
        self.process_group = process_group
        self.register_load_state_dict_post_hook(_rebuild_student)
        if process_group is not None:
            self._check_same_problem()
        if not given and not _forward_matches_modules(
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
        mean_module: gpytorch.means.Mean | None = None,
        **options: Any,
    ) -> KernelDistillation:
        r"""Distil the GP given by its training data, kernel and noise variance (no teacher model).

        Usage::

            distiller = KernelDistillation.from_data(
                train_x, train_y, covar_module, noise=0.01, num_inducing=100, sparsity=10
            ).fit()

        :param train_x: training inputs, shape ``(n, d)`` or ``(n,)``.
        :param train_y: training targets, shape ``(n,)``.
        :param covar_module: the GP's (trained) kernel, without batch shape; copied.
        :param noise: the observation noise variance :math:`\sigma^2`, one positive value.
        :param mean_module: ``None`` or a ``ZeroMean`` (prior mean 0) or a ``ConstantMean``.
        :param options: the constructor's keyword arguments (``num_inducing``, ``sparsity``,
            ``max_iter``, ...), except ``require_trained``.
        """
        _refuse(options, ("require_trained",), "from_data")
        if options.get("process_group") is not None:
            check_group(options["process_group"])
        return cls(
            _Problem.from_data(train_x, train_y, covar_module, noise, mean_module), **options
        )

    @classmethod
    def from_sgpr(cls, model: ExactGP, *, sparsity: int, **options: Any) -> KernelDistillation:
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
        :param options: the constructor's other keyword arguments (``max_iter``, ``descent``,
            ``require_trained``, ...), except those the SGPR fixes: ``num_inducing``,
            ``inducing_points``, ``kmeans_max_iter`` and ``seed``.
        """
        _refuse(
            options, ("num_inducing", "inducing_points", "kmeans_max_iter", "seed"), "from_sgpr"
        )
        if options.get("process_group") is not None:
            check_group(options["process_group"])
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
        problem = _Problem.from_teacher(model, options.get("require_trained", True))
        u = inducing_kernel.inducing_points.detach()
        d = problem.train_x.shape[-1]
        if u.dim() != 2 or u.shape[-1] != d:
            raise ValueError(
                "model.covar_module.inducing_points must have shape (m, "
                f"d={d}) like the training inputs, got {tuple(u.shape)}"
            )
        problem = _Problem.checked(
            inducing_kernel.base_kernel,
            problem.train_x,
            problem.train_y,
            problem.noise,
            problem.mean_constant,
        )
        obj = cls(problem, num_inducing=u.shape[0], sparsity=sparsity, inducing_points=u, **options)
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

    # ------------------------------------------------------------------ saved state and moves
    def get_extra_state(self) -> dict:
        """The mean constant, ``frobenius_errors`` and whether the distiller is fitted, saved
        in ``state_dict`` (the student is rebuilt from the buffers on loading)."""
        return {
            "mean_constant": self.mean_constant,
            "frobenius_errors": list(self.frobenius_errors),
            "fitted": self._fitted,
        }

    def set_extra_state(self, state: dict) -> None:
        self.mean_constant = float(state["mean_constant"])
        self.frobenius_errors = [float(e) for e in state["frobenius_errors"]]
        self._fitted = bool(state["fitted"])
        self._student = None  # rebuilt from the loaded buffers once they are loaded

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the learnt buffers take the saved ones' presence and shapes (a new distiller has none)
        for name in _LEARNT_BUFFERS:
            saved = state_dict.get(prefix + name)
            if not isinstance(saved, Tensor):
                setattr(self, name, None)
            elif getattr(self, name) is None:
                dtype = saved.dtype if not saved.is_floating_point() else self.train_x.dtype
                setattr(self, name, torch.empty(0, dtype=dtype, device=self.train_x.device))
        adopt_buffer_shapes(self, state_dict, prefix, ("train_x", "train_y", *_LEARNT_BUFFERS))
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self._student is not None:
            self._student._apply(fn, recurse)
        return self

    # ------------------------------------------------------------------ building blocks
    def _objective(self) -> SparseKernelObjective:
        """The objective on the current pattern (preparing first where :meth:`prepare` has
        not run)."""
        if self.neighbour_indices is None:
            self.prepare()
        return SparseKernelObjective(
            self.covar_module,
            self.train_x,
            self.inducing_points,
            self.neighbour_indices,
            chunk_size=self.chunk_size,
            inducing_covariance=self.inducing_covariance,
            process_group=self.process_group,
        )

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
        selection = select_inducing_points(
            self.train_x,
            self.num_inducing,
            self.sparsity,
            scale=self.neighbour_scale,
            inducing_points=self.inducing_points,
            kmeans_max_iter=self.kmeans_max_iter,
            seed=self.seed,
            process_group=self.process_group,
            task=task,
            progress=progress,
            callback=callback,
        )
        self.inducing_points = selection.inducing_points
        self.neighbour_indices = selection.neighbour_indices  # shape: (n, b)
        objective = SparseKernelObjective(
            self.covar_module,
            self.train_x,
            self.inducing_points,
            self.neighbour_indices,
            chunk_size=self.chunk_size,
            process_group=self.process_group,
        )
        self.inducing_covariance = objective.inducing_covariance
        blocks = len(objective.least_squares_blocks())
        if selection.stopped:  # the later phases run whole, without further records
            callback = None
        with ProgressReporter(task, blocks, progress, callback, phase="least squares") as report:
            self.initial_weight_values = objective.least_squares_weights(report)
        self.weight_values = self.initial_weight_values.clone()
        self.timings.update(
            kmeans=selection.kmeans_seconds,
            initialisation=time.perf_counter() - t0 - selection.kmeans_seconds,
        )
        return selection.stopped or report.stopped

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
        return self._objective().least_squares_weights()

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
        return self._objective().objective_and_gradient(values, gradient=gradient)

    def frobenius_error(self, values: Tensor | None = None) -> float:
        r""":math:`\|K_{XX} - W K_{UU} W^\top\|_F` (chunked), at ``values`` or the current ``W``
        (collective with a :attr:`process_group`)."""
        objective = self._objective()
        return objective.frobenius_error(self.weight_values if values is None else values)

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
        return self._objective().block_direction(values, gradient)

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
        with ProgressReporter(
            "KernelDistillation.fit", max_iter, progress, callback, phase="descent"
        ) as report:
            values, errors = self._objective().descend(
                self.weight_values,
                max_iter,
                lr=self.lr,
                optimizer=self.optimizer,
                descent=self.descent,
                report=report,
            )
        self.weight_values = values
        self.frobenius_errors = errors
        # the exact line search never raises the error (beyond rounding); fixed steps can
        line_search = self.lr is None and self.optimizer is None
        grew = not line_search and errors[-1] > 1.001 * errors[0]
        if grew:
            warn(
                f"kernel distillation ended with a larger error ||K - WKW^T||_F = {errors[-1]:.3e} "
                f"than it started with ({errors[0]:.3e}): {step_rule(self.lr, self.optimizer)} "
                "is too large; lower it, or use the exact line search (lr=None, the default)",
                RuntimeWarning,
            )
        t1 = time.perf_counter()
        try:
            self._set_student(self._build_student())
        except RuntimeError as err:
            if not grew:
                raise
            raise RuntimeError(
                f"kernel distillation diverged (||K - WKW^T||_F grew from {errors[0]:.3e} to "
                f"{errors[-1]:.3e}), and the student cannot be built from its weights: "
                f"{step_rule(self.lr, self.optimizer)} is too large; lower it, or use the exact "
                "line search (lr=None, the default)"
            ) from err
        self._fitted = True
        self.timings.update(optimisation=t1 - t0, student=time.perf_counter() - t1)
        return self

    def _set_student(self, student: SparseLowRankStudent) -> None:
        # outside the module tree: the state_dict holds what the student is built from, so that
        # it loads into a distiller that has none yet; _apply moves it with the distiller
        object.__setattr__(self, "_student", student)

    def _build_student(self) -> SparseLowRankStudent:
        """The student of the current :math:`W`."""
        return SparseLowRankStudent.from_sparse_weights(
            self.covar_module,
            self.inducing_points,
            self.weight_values,
            self.neighbour_indices,
            self.train_y,
            self.noise,
            mean_constant=self.mean_constant,
            inducing_covariance=self.inducing_covariance,
            jitter=self.jitter,
            neighbour_scale=self.neighbour_scale,
        )

    def dense_weights(self, values: Tensor | None = None) -> Tensor:
        """:math:`W` as a dense ``(n, m)`` matrix (for inspection of small problems)."""
        objective = self._objective()
        return objective.dense_weights(self.weight_values if values is None else values)
