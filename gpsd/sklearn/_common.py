"""What the scikit-learn adapters share: kernels from simple hyperparameters, arrays to tensors,
the exact-GP teacher fit, seeds and target standardisation."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator

import gpytorch
import numpy as np
import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from sklearn.utils import check_random_state
from torch import Tensor

KERNELS = ("rbf", "matern12", "matern32", "matern52")
DTYPES = {"float64": torch.float64, "float32": torch.float32}
TEACHER_NOISE_INIT = 0.1  # the teacher's observation noise before (or without) optimisation


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype named by an estimator's ``dtype`` hyperparameter."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def numpy_dtype(dtype: str) -> type:
    torch_dtype(dtype)
    return np.float64 if dtype == "float64" else np.float32


def torch_device(device: object) -> torch.device:
    """The torch device named by an estimator's ``device`` hyperparameter (``"cpu"``,
    ``"cuda"``, ``"cuda:1"``, a ``torch.device``), checked to be available."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device must name a torch device ('cpu', 'cuda'), got {device!r}"
        ) from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {device!r}, but torch sees no CUDA device here")
    return resolved


def to_tensor(array: np.ndarray, dtype: str, device: object = "cpu") -> Tensor:
    """A tensor owning a copy of ``array`` (a read-only or memory-mapped array stays untouched),
    on ``device``."""
    return torch.from_numpy(np.array(array, dtype=numpy_dtype(dtype), copy=True)).to(device)


def to_numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


def make_kernel(
    kernel: str,
    lengthscale: float,
    outputscale: float,
    dtype: torch.dtype,
    ard_num_dims: int | None = None,
) -> gpytorch.kernels.ScaleKernel:
    r""":math:`s\,k_\ell`: a ``ScaleKernel`` over an RBF or Matérn kernel with the given
    lengthscale :math:`\ell` and outputscale :math:`s`; with ``ard_num_dims``, one lengthscale
    per input feature, each started at :math:`\ell`."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    check_positive(lengthscale, "lengthscale")
    check_positive(outputscale, "outputscale")
    if kernel == "rbf":
        base = gpytorch.kernels.RBFKernel(ard_num_dims=ard_num_dims)
    else:
        nu = {"12": 0.5, "32": 1.5, "52": 2.5}[kernel[-2:]]
        base = gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=ard_num_dims)
    covar_module = gpytorch.kernels.ScaleKernel(base).to(dtype)
    covar_module.base_kernel.lengthscale = float(lengthscale)
    covar_module.outputscale = float(outputscale)
    return covar_module


def check_positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def check_count(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class _Teacher(gpytorch.models.ExactGP):
    def __init__(self, x: Tensor, y: Tensor, covar_module, likelihood) -> None:
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = covar_module

    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def fit_exact_gp(
    train_x: Tensor,
    train_y: Tensor,
    covar_module: gpytorch.kernels.Kernel,
    *,
    optimize: bool,
    max_iter: int,
    lr: float,
) -> tuple[gpytorch.models.ExactGP, float]:
    r"""An exact GP teacher (zero mean, Gaussian likelihood) on the data; with ``optimize``, its
    kernel's hyperparameters and the noise maximise the exact log marginal likelihood by Adam
    (``max_iter`` iterations, learning rate ``lr``). Returns the teacher, in evaluation mode, and
    its noise variance :math:`\sigma^2` (``TEACHER_NOISE_INIT`` without ``optimize``)."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood(
        noise_constraint=gpytorch.constraints.GreaterThan(1e-6)
    ).to(train_x)
    likelihood.noise = TEACHER_NOISE_INIT
    teacher = _Teacher(train_x, train_y, covar_module, likelihood)
    if optimize and max_iter > 0:
        # the exact negative log marginal likelihood (per point) from one dense Cholesky
        # factorisation: GPyTorch's ExactMarginalLogLikelihood, without its operator overhead
        optimizer = torch.optim.Adam(teacher.parameters(), lr=lr)
        eye = torch.eye(train_x.shape[-2], dtype=train_x.dtype, device=train_x.device)
        for _ in range(max_iter):
            optimizer.zero_grad()
            gram = covar_module(train_x).to_dense() + likelihood.noise * eye
            chol = psd_safe_cholesky(gram)
            weights = torch.cholesky_solve(train_y.unsqueeze(-1), chol).squeeze(-1)
            loss = 0.5 * train_y @ weights + chol.diagonal().log().sum()
            (loss / train_y.shape[-1]).backward()
            optimizer.step()
        teacher.eval()
        likelihood.eval()
        return teacher, float(likelihood.noise.detach().reshape(-1)[0])
    teacher.eval()
    likelihood.eval()
    return teacher, TEACHER_NOISE_INIT  # exact: not rounded through the noise constraint


def seed_from(random_state: object) -> int:
    """An integer seed drawn from ``random_state`` (``None``, an ``int`` or a ``RandomState``)."""
    return int(check_random_state(random_state).randint(np.iinfo(np.int32).max))


@contextlib.contextmanager
def torch_seed(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator inside the block and restore its state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def standardise(y: np.ndarray, normalize_y: bool) -> tuple[np.ndarray, float, float]:
    """``(y - mean) / std`` with ``normalize_y`` (a constant ``y`` keeps std 1), else ``y``."""
    if not normalize_y:
        return y, 0.0, 1.0
    mean = float(np.mean(y))
    std = float(np.std(y))
    if not std > 0 or not np.isfinite(std):
        std = 1.0
    return (y - mean) / std, mean, std


def check_numeric_targets(y: object) -> None:
    """Refuse regression targets held as strings (labels, or numbers written out) with a
    ``ValueError`` naming ``y``, before numpy's arithmetic meets them; numbers held as Python
    objects pass, for scikit-learn's validation to convert."""
    array = np.asarray(y)
    if array.dtype.kind not in "USO":  # not strings: scikit-learn's validation judges the rest
        return
    if array.dtype.kind == "O":  # scikit-learn converts numbers held as objects
        with contextlib.suppress(TypeError, ValueError):
            array.astype(np.float64)
            return
    first = array.reshape(-1)[:1].tolist()
    raise ValueError(
        f"y must hold numbers (regression targets), got an array of dtype {array.dtype}"
        + (f" starting {first[0]!r}" if first else "")
        + "; convert the targets to floats, or use SelfDistilledGPClassifier for class labels"
    )


def regression_data(
    estimator: object, X: object, y: object, device: object = "cpu"
) -> tuple[Tensor, Tensor]:
    """``X, y`` validated for ``estimator`` (setting ``n_features_in_``), the targets standardised
    where ``estimator.normalize_y`` (their mean and scale kept as ``_y_mean``, ``_y_std``), as
    tensors in ``estimator.dtype`` on ``device``: ``(N, d)`` and ``(N,)``."""
    from sklearn.utils.validation import validate_data

    check_numeric_targets(y)
    X, y = validate_data(
        estimator, X, y, y_numeric=True, ensure_min_samples=2, dtype=numpy_dtype(estimator.dtype)
    )
    y, estimator._y_mean, estimator._y_std = standardise(y, estimator.normalize_y)
    return to_tensor(X, estimator.dtype, device), to_tensor(y, estimator.dtype, device)


def teacher_kernel(
    estimator: object, train_x: Tensor, train_y: Tensor, max_iter: int, ard: bool = False
) -> tuple[gpytorch.kernels.Kernel, float]:
    """The kernel of ``estimator``'s hyperparameters (with ``ard``, one lengthscale per input
    feature), on ``train_x``'s device, fitted with the exact-GP teacher (:func:`fit_exact_gp`,
    where ``estimator.optimize_hyperparameters``), and the teacher's noise. The kernel's
    parameters are frozen: constants to the distiller, which then builds no graph."""
    covar_module = make_kernel(
        estimator.kernel,
        estimator.lengthscale,
        estimator.outputscale,
        train_x.dtype,
        ard_num_dims=train_x.shape[-1] if ard else None,
    ).to(train_x.device)
    _, noise = fit_exact_gp(
        train_x,
        train_y,
        covar_module,
        optimize=bool(estimator.optimize_hyperparameters),
        max_iter=max_iter,
        lr=check_positive(estimator.lr, "lr"),
    )
    for parameter in covar_module.parameters():
        parameter.requires_grad_(False)
    return covar_module, noise
