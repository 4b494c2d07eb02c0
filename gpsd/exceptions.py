"""The exceptions gpsd raises for conditions of its own.

Each also derives from the built-in exception a caller would catch without knowing gpsd
(``RuntimeError``, ``MemoryError``), so ``except RuntimeError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "DistributedError",
    "GpsdError",
    "InsufficientMemoryError",
    "LaplaceConvergenceError",
    "NonFiniteEmbeddingsError",
    "NotFittedError",
    "TeacherError",
]


class GpsdError(Exception):
    """Base class of the exceptions gpsd raises for conditions of its own."""


class NotFittedError(GpsdError, RuntimeError):
    """An estimator that trains was asked to predict (or for a fitted attribute) before ``fit()``.

    Closed-form estimators (the regression distillers, :class:`~gpsd.LaplaceGPClassifier`, the GPC
    distillers) fit lazily on first use and never raise it.
    """


class BackendError(GpsdError, RuntimeError):
    """A linear-algebra backend cannot do what was asked (for example, build an autograd graph);
    the message names the backends that can."""


class InsufficientMemoryError(GpsdError, MemoryError):
    """A computation does not fit in the device's memory. Raised before allocating where the
    need can be foreseen (a forced dense or Cholesky backend, the fits of the Laplace classifier
    and the GPC distillers), else when an allocation fails; the message names the bytes and what
    would fit instead."""


class DistributedError(GpsdError, RuntimeError):
    """A collective over a ``torch.distributed`` process group failed: another rank failed or
    left, called other methods, or did not join within the group's ``timeout``. Raised on each
    rank that was waiting in the collective, with the rank and the operation in the message."""


class TeacherError(GpsdError, TypeError, ValueError):
    """A teacher given to a distiller (``from_teacher``, :class:`~gpsd.KernelDistillation`,
    :class:`~gpsd.PosteriorMean`, :class:`~gpsd.PosteriorKernel`) is not what it needs: a
    trained GPyTorch ``ExactGP`` with the likelihood it names, one training input tensor,
    training data, ``mean_module`` and ``covar_module``. The message names the attribute of
    ``teacher`` at fault. Also a ``TypeError`` and a ``ValueError``, the exceptions of a bad
    argument."""


class LaplaceConvergenceError(GpsdError, RuntimeError):
    r"""Newton's method for the Laplace mode did not converge (:func:`~gpsd.laplace.find_laplace_mode`):
    it ran out of iterations, or the Laplace matrix :math:`\mathbf B` is not positive definite;
    the message says which, and what to change."""


class NonFiniteEmbeddingsError(GpsdError, ValueError):
    """A DPKL feature extractor produced NaN or infinite embeddings; the message counts the input
    rows affected (and, in ``fit``, names the iteration)."""
