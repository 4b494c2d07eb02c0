r"""What the GPC self-distillers do for :math:`K > 2` classes: the number of classes, the class
priors, the data-centric chain of multiclass Laplace fits, the tempered softmax posterior, and
predictions of a step.

Every step is a :class:`~gpsd.laplace.MulticlassLaplacePosterior` of :math:`K` latent functions,
independent a priori. Each class's prior is :math:`\mathcal{GP}(m_c, k_c)`: the kernel (and the
prior mean) is shared by the :math:`K` latent functions unless it has batch shape ``(K,)``, in
which case entry :math:`c` is class :math:`c`'s. Class probabilities are Monte Carlo averages of
the softmax over draws from the latent predictive (:func:`~gpsd.laplace.multiclass_expectation`):
the same draws at every call and for every point, so that a point's probabilities depend neither on the
call nor on the other points predicted with it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean
from torch import Tensor

from gpsd._internal.memory_check import check_dense_matrices_fit
from gpsd._internal.negligible import kernel_matrix
from gpsd._internal.validation import as_float_tensor, check_int, check_same_device, check_vector
from gpsd._internal.variance import nonnegative_variance
from gpsd.laplace import (
    ContinuousCategoricalTerms,
    MulticlassLaplacePosterior,
    SoftmaxTerms,
    TemperedSoftmaxTerms,
    constant_parameters,
    multiclass_expectation,
)
from gpsd.prediction import Prediction

__all__ = [
    "DEFAULT_NUM_SAMPLES",
    "SoftmaxLabelTerms",
    "check_class_memory",
    "check_class_modules",
    "class_latent",
    "class_log_loss",
    "class_prior_at_training",
    "class_probabilities",
    "data_centric_chain",
    "infer_num_classes",
    "refuse_for_classes",
    "tempered_posterior",
]

#: Monte Carlo draws of the class probabilities where the model is not told otherwise
DEFAULT_NUM_SAMPLES = 4096


def _softmax(latents: Tensor) -> Tensor:
    return torch.softmax(latents, dim=-1)


def infer_num_classes(train_y: object, num_classes: object) -> int:
    r""":math:`K`: ``num_classes`` where given (an ``int >= 2``), else, where a label is an
    integer of at least 2, one more than the largest label (the labels must then be integers in
    ``0 ... K - 1``: a ``ValueError`` naming ``train_y`` otherwise), and 2 for any other labels
    (the binary classifier, whose own check then judges them)."""
    if num_classes is not None:
        if not isinstance(num_classes, bool) and num_classes == 1:
            raise ValueError(
                "num_classes must be an integer >= 2, got 1: one class leaves nothing to classify"
            )
        return check_int(num_classes, "num_classes", minimum=2)
    y = as_float_tensor(train_y, "train_y")
    if not bool(torch.isfinite(y).all()) or not bool(((y >= 2) & (y == y.round())).any()):
        return 2
    K = int(y.max().floor()) + 1
    SoftmaxLabelTerms(K).check_targets(y, "train_y")
    return K


class SoftmaxLabelTerms(SoftmaxTerms):
    r"""The softmax terms of labels in ``0 ... K - 1`` for a fixed :math:`K`, whose
    :meth:`check_targets` checks training labels as the binary terms do
    (:class:`~gpsd.laplace.ClassificationTrainingData`)."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def check_targets(self, y: Tensor, name: str = "train_y") -> None:
        """A ``ValueError`` naming ``name`` unless ``y`` holds integer labels in
        ``0 ... K - 1`` (checked without forming the one-hot rows)."""
        if not bool(torch.isfinite(y).all()):
            raise ValueError(f"{name} must be finite, but it holds NaN or infinite values")
        K = self.num_classes
        bad = (y != y.round()) | (y < 0) | (y > K - 1)
        if bool(bad.any()):
            raise ValueError(
                f"{name} must hold integer class labels in 0 ... {K - 1} (num_classes={K}), "
                f"got values such as {y[bad].flatten()[:3].tolist()}"
            )


def refuse_for_classes(num_classes: int, name: str, value: object, allowed: str) -> None:
    """A ``ValueError`` naming the setting ``name`` whose ``value`` the :math:`K`-class steps do
    not have; ``allowed`` says what to use."""
    raise ValueError(f"{name}={value!r} is for two classes; with {num_classes} classes {allowed}")


def _per_class(module: Kernel | Mean, num_classes: int) -> bool:
    return tuple(getattr(module, "batch_shape", ())) == (num_classes,)


def check_class_modules(covar_module: Kernel, mean_module: Mean, num_classes: int) -> None:
    """A ``ValueError`` unless the kernel and the prior mean have batch shape ``()`` (shared by
    the :math:`K` latent functions) or ``(K,)`` (one per class)."""
    for name, module in (("covar_module", covar_module), ("mean_module", mean_module)):
        shape = tuple(getattr(module, "batch_shape", ()))
        if shape not in ((), (num_classes,)):
            raise ValueError(
                f"with {num_classes} classes, {name} must have batch shape () (shared by the "
                f"{num_classes} latent functions) or ({num_classes},) (one per class), got "
                f"{shape}"
            )


def _class_inputs(module: Kernel | Mean, x: Tensor, num_classes: int) -> Tensor:
    """``x`` with a class dimension before the points where ``module`` is one per class."""
    return x.unsqueeze(-3) if _per_class(module, num_classes) else x


def _class_mean(mean_module: Mean, x: Tensor, num_classes: int) -> Tensor:
    """The prior mean at ``x`` as ``(*b, n, K)`` (one per class) or ``(*b, n, 1)`` (shared)."""
    if _per_class(mean_module, num_classes):
        return mean_module(x.unsqueeze(-3)).to(x.dtype).transpose(-1, -2)
    return mean_module(x).to(x.dtype).unsqueeze(-1)


def class_prior_at_training(
    covar_module: Kernel, mean_module: Mean, x: Tensor, num_classes: int
) -> tuple[Tensor, Tensor]:
    r"""The prior mean ``(*b, n, K|1)`` and covariances ``(*b, K|1, n, n)`` of the :math:`K`
    latent functions at the training inputs ``x`` ``(*b, n, d)``, in ``x``'s dtype."""
    K = kernel_matrix(covar_module, _class_inputs(covar_module, x, num_classes)).to(x.dtype)
    if not _per_class(covar_module, num_classes):
        K = K.unsqueeze(-3)
    return _class_mean(mean_module, x, num_classes), K


def _class_prior_at_test(
    covar_module: Kernel, mean_module: Mean, x: Tensor, train_x: Tensor, num_classes: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``k_c(x, X)`` ``(*b, K|1, m, n)``, ``k_c(x, x)`` ``(*b, K|1, m)`` and the prior mean
    ``(*b, m, K|1)`` at the test inputs ``x``, in ``train_x``'s dtype."""
    dtype = train_x.dtype
    x_c = _class_inputs(covar_module, x, num_classes)
    train_c = _class_inputs(covar_module, train_x, num_classes)
    cross = kernel_matrix(covar_module, x_c, train_c).to(dtype)
    diag = covar_module(x_c, diag=True).to(dtype)
    if not _per_class(covar_module, num_classes):
        cross, diag = cross.unsqueeze(-3), diag.unsqueeze(-2)
    return cross, diag, _class_mean(mean_module, x, num_classes).to(dtype)


def check_class_memory(
    task: str, x: Tensor, batch: torch.Size, num_classes: int, kept: int, dense: bool
) -> None:
    r"""Raise :class:`~gpsd.InsufficientMemoryError` before a fit that keeps ``kept`` multiclass
    posteriors on inputs ``x`` where their matrices of size :math:`n` do not fit: each holds the
    :math:`K` prior covariances and its factorisation (:math:`K^2` matrices where ``dense``,
    :math:`K + 1` for the softmax's), besides the kernel matrices of the fit (a count of the
    tensors held, not a measurement)."""
    factor = num_classes**2 if dense else num_classes + 1
    check_dense_matrices_fit(
        task,
        num_classes + kept * (num_classes + factor),
        x,
        batch,
        f"the class covariances and the factorisations of the {kept} steps it keeps",
        "fit fewer steps or points, or in float32 for half the bytes",
    )


def data_centric_chain(
    train_x: Tensor,
    labels: Tensor,
    covar_module: Kernel,
    mean_module: Mean,
    noise: Tensor,
    num_classes: int,
    *,
    max_iter: int,
    num_samples: int,
    warm_start: bool = False,
    stored_modes: Tensor | None = None,
) -> Iterator[MulticlassLaplacePosterior]:
    r"""The Laplace posteriors of the data-centric steps :math:`t = 1, 2, \dots`, one per
    iteration (the caller stops where it likes).

    Step 1 fits the softmax likelihood to the labels, step :math:`t \ge 2` the continuous
    categorical to the soft targets :math:`\mathbf Y_t`, step :math:`t - 1`'s class
    probabilities :math:`\mathbb{E}[\operatorname{softmax}(\mathbf f)]` at the training inputs
    (without its noise); step :math:`t`'s prior covariance is :math:`\mathbf K_c + \gamma_t
    \mathbf I` for every class :math:`c`.

    :param train_x: Training inputs ``(*b, n, d)``.
    :param labels: Labels ``(*b, n)`` in ``0 ... K - 1``.
    :param noise: The schedules :math:`\gamma` ``(*s, T)``.
    :param warm_start: Start each step's Newton run from the previous step's :math:`\mathbf a`.
    :param stored_modes: Modes of an earlier fit ``(T, *batch, n, K)``, row ``t - 1`` the start
        of step :math:`t` (before ``warm_start``).
    """
    m, K = class_prior_at_training(covar_module, mean_module, train_x, num_classes)
    n = K.shape[-1]
    eye = torch.eye(n, dtype=K.dtype, device=K.device)
    variance = torch.diagonal(K, dim1=-2, dim2=-1)  # shape: (*b, K|1, n)
    targets = labels
    previous = None
    for step in range(1, noise.shape[-1] + 1):
        gamma = noise[..., step - 1]  # shape: (*s,)
        covariance = K if bool((gamma == 0).all()) else K + gamma[..., None, None, None] * eye
        terms = SoftmaxTerms() if step == 1 else ContinuousCategoricalTerms()
        stored = None if stored_modes is None else stored_modes[step - 1]
        # the previous step's a: its prior covariance differs from this one's by a multiple of I
        warm = previous.alpha if warm_start and previous is not None and stored is None else None
        posterior = MulticlassLaplacePosterior(
            m,
            covariance,
            terms,
            targets,
            num_classes=num_classes,
            init_f=stored,
            init_alpha=warm,
            max_iter=max_iter,
        )
        yield posterior
        previous = posterior
        mean, covariance = posterior.predictive(K, variance, m)
        targets = multiclass_expectation(_softmax, mean, covariance, num_samples)


def tempered_posterior(
    train_x: Tensor,
    labels: Tensor,
    covar_module: Kernel,
    mean_module: Mean,
    num_classes: int,
    temperature: float,
    *,
    max_iter: int,
    init_alpha: Tensor | None = None,
) -> MulticlassLaplacePosterior:
    r"""The Laplace posterior of the softmax likelihood raised to ``temperature`` :math:`t` under
    the class priors :math:`\mathcal{GP}(m_c, k_c)` (the softmax itself at :math:`t = 1`),
    Newton's method started from :math:`\mathbf f = \mathbf m + \mathbf K` ``init_alpha``
    (default: the prior mean)."""
    m, K = class_prior_at_training(covar_module, mean_module, train_x, num_classes)
    terms = SoftmaxTerms() if temperature == 1.0 else TemperedSoftmaxTerms(temperature)
    return MulticlassLaplacePosterior(
        m, K, terms, labels, num_classes=num_classes, init_alpha=init_alpha, max_iter=max_iter
    )


def class_latent(
    owner: torch.nn.Module, posterior: MulticlassLaplacePosterior, modules: object, x: Tensor
) -> Prediction:
    r"""The latent predictive of ``posterior``, whose kernel and prior mean are ``modules``'
    ``covar_module`` and ``mean_module``, at checked test inputs ``x``: the mean
    ``(*b, m, K)``, the variances ``(*b, m, K)`` and the covariance between the classes at each
    point ``(*b, m, K, K)`` (R&W Algorithm 3.4). ``owner``'s parameters are constants to it."""
    with constant_parameters(owner):
        cross, diag, prior_mean = _class_prior_at_test(
            modules.covar_module,
            modules.mean_module,
            x,
            owner.train_inputs,
            posterior.num_classes,
        )
    mean, covariance = posterior.predictive(cross, diag, prior_mean)
    variance = torch.diagonal(covariance, dim1=-2, dim2=-1)
    return Prediction(mean, nonnegative_variance(variance, diag.transpose(-1, -2)), covariance)


def class_probabilities(
    owner: torch.nn.Module, posterior: MulticlassLaplacePosterior, modules: object, x: Tensor
) -> Tensor:
    """The class probabilities of ``posterior`` (with ``modules`` as for :func:`class_latent`)
    at checked test inputs ``x``, ``(*b, m, K)``: :func:`~gpsd.laplace.multiclass_expectation` of the softmax with
    ``owner.num_samples`` draws."""
    with torch.no_grad():
        cross, diag, prior_mean = _class_prior_at_test(
            modules.covar_module,
            modules.mean_module,
            x,
            owner.train_inputs,
            posterior.num_classes,
        )
        mean, covariance = posterior.predictive(cross, diag, prior_mean)
        return multiclass_expectation(_softmax, mean, covariance, owner.num_samples)


def class_log_loss(proba: Tensor, val_y: object) -> Tensor:
    r"""The mean log loss of every step, ``(*batch, T)``, from the class probabilities ``proba``
    ``(*batch, T, M, K)`` and the labels ``val_y`` ``(*batch, M)`` in ``0 ... K - 1``:
    :math:`-\frac1M \sum_i \log p_{t,i,y_i}` (probabilities clamped to the smallest positive
    normal number before the logarithm)."""
    y = as_float_tensor(val_y, "val_y", dtype=proba.dtype)
    check_same_device(proba, y, "val_y", "val_x")
    check_vector(y, "val_y", n=proba.shape[-2])
    Y = SoftmaxTerms().targets(y, proba.shape[-1], "val_y")  # shape: (*batch, M, K)
    log_p = proba.clamp_min(torch.finfo(proba.dtype).tiny).log()
    return -(Y.unsqueeze(-3) * log_p).sum(-1).mean(-1)
