"""K-means with k-means++ seeding, batched on the device of the data.

Kernel distillation (Song & Sun, §2 and Algorithm 1) places the ``m`` inducing points at the
centroids of a K-means clustering of the training inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpsd._internal.distances import squared_distances
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.validation import as_float_tensor, check_int, check_matrix, check_positive_float
from gpsd.kernel_distillation.nearest_inducing import nearest_inducing_points
from gpsd.progress import Callback

__all__ = ["kmeans", "kmeans_plus_plus"]


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def kmeans_plus_plus(x: Tensor, num_clusters: int, *, seed: int = 0) -> Tensor:
    r"""k-means++ seeding (Arthur & Vassilvitskii, 2007).

    The first centre is drawn uniformly; every further centre is drawn with probability
    proportional to :math:`D(x)^2`, the squared distance to the nearest centre chosen so far.

    :param x: inputs, shape ``(n, d)``.
    :param num_clusters: number of centres ``k`` (``1 <= k <= n``).
    :param seed: seed of the device's random generator, a non-negative integer.
    :return: the centres, shape ``(k, d)``, rows of ``x``.
    """
    seed = check_int(seed, "seed", minimum=0)
    x = check_matrix(as_float_tensor(x, "x"), "x")
    if x.dim() != 2:
        raise ValueError(f"x must have shape (n, d), got {tuple(x.shape)}")
    n = x.shape[0]
    num_clusters = check_int(num_clusters, "num_clusters")
    if num_clusters > n:
        raise ValueError(f"num_clusters must lie in [1, n={n}], got {num_clusters}")
    gen = _generator(seed, x.device)
    first = torch.randint(n, (1,), generator=gen, device=x.device)
    chosen = [first]
    d2 = squared_distances(x, x[first]).squeeze(-1)  # shape: (n,)
    for _ in range(1, num_clusters):
        total = d2.sum()
        if total > 0:
            idx = torch.multinomial(d2 / total, 1, generator=gen)
        else:  # every point coincides with a centre already: draw uniformly
            idx = torch.randint(n, (1,), generator=gen, device=x.device)
        chosen.append(idx)
        d2 = torch.minimum(d2, squared_distances(x, x[idx]).squeeze(-1))
    return x[torch.cat(chosen)]


def kmeans(
    x: Tensor,
    num_clusters: int,
    *,
    max_iter: int = 50,
    tol: float = 1e-6,
    seed: int = 0,
    chunk_size: int | None = None,
    progress: object = False,
    callback: Callback | None = None,
) -> Tensor:
    r"""Lloyd's K-means from a k-means++ start.

    Each iteration assigns every input to its nearest centre (a chunked exact search) and moves each
    centre to the mean of its inputs. A centre that loses all its inputs is moved to the input
    farthest from the centre it is assigned to. Stops after ``max_iter`` iterations or when no
    centre moves by more than ``tol`` times the inputs' scale.

    :param x: inputs, shape ``(n, d)``.
    :param num_clusters: number of centroids ``k``.
    :param max_iter: the most Lloyd iterations (0: the k-means++ start).
    :param tol: relative shift below which the iterations stop, a non-negative float.
    :param seed: seed of the k-means++ seeding (a non-negative integer).
    :param progress: ``False``, ``True`` (a ``tqdm`` bar) or a ``tqdm`` bar to advance, one
        step per Lloyd iteration (see :mod:`gpsd.progress`).
    :param callback: called after every Lloyd iteration with an :class:`~gpsd.IterationRecord`
        of task ``"kmeans"``: ``loss`` the mean squared distance of the inputs to the centre they
        were assigned to in the iteration, ``info["shift"]`` the largest move of a centre
        relative to the inputs' scale. Returning ``True`` stops: the centroids reached are
        returned.
    :return: the centroids, shape ``(k, d)``.
    """
    check_progress(progress, callback)
    max_iter = check_int(max_iter, "max_iter", minimum=0)
    chunk_size = check_int(chunk_size, "chunk_size", optional=True)
    tol = check_positive_float(tol, "tol", allow_zero=True)
    centres = kmeans_plus_plus(x, num_clusters, seed=seed)
    x = check_matrix(as_float_tensor(x, "x"), "x")
    # population variance: defined (no warning, no NaN) for a single input too
    scale = x.var(0, correction=0).sum().clamp_min(torch.finfo(x.dtype).tiny).sqrt()
    reporting = callback is not None or (progress is not False and progress is not None)
    with ProgressReporter("kmeans", max_iter, progress, callback) as report:
        for iteration in range(1, max_iter + 1):
            centres, shift, objective = _lloyd_iteration(x, centres, chunk_size)
            if reporting and report.update(iteration, loss=objective, shift=float(shift / scale)):
                break
            if shift <= tol * scale:
                break
    return centres


def _lloyd_iteration(
    x: Tensor, centres: Tensor, chunk_size: int | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One Lloyd iteration from ``centres`` (``(k, d)``): the new centres, the largest move of a
    centre, and the mean squared distance of the inputs ``x`` (``(n, d)``) to the centres they
    were assigned to."""
    k = centres.shape[0]
    d2, assign = nearest_inducing_points(x, centres, 1, chunk_size=chunk_size)
    d2, assign = d2.squeeze(-1), assign.squeeze(-1)  # shape: (n,)
    # the mean of a cluster as its centre plus the mean offset of its inputs from it: sums of
    # the inputs themselves lose about eps * |x| per input to rounding (float32 inputs near
    # 2000 would move every centre by about 0.04), sums of the offsets eps * the cluster radius
    offsets = torch.zeros_like(centres).index_add_(0, assign, x - centres[assign])
    counts = torch.zeros(k, dtype=x.dtype, device=x.device).index_add_(
        0, assign, torch.ones_like(d2)
    )
    new = centres + offsets / counts.clamp_min(1.0).unsqueeze(-1)
    empty = counts == 0
    if bool(empty.any()):
        far = torch.topk(d2, int(empty.sum())).indices
        new[empty] = x[far]
    shift = (new - centres).norm(dim=-1).max()
    return new, shift, d2.mean()
