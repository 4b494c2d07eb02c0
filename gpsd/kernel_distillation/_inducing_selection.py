r"""Inducing points and neighbourhoods of kernel distillation: the ``m`` K-means centroids
:math:`U` of the training inputs and, for every input :math:`x_i`, the ``b`` nearest of them
:math:`J_i`, both in the metric :math:`x / s` of the neighbour scale :math:`s`, each phase
reported."""

from __future__ import annotations

import dataclasses
import time

from torch import Tensor

from gpsd._internal.collectives import all_gather
from gpsd._internal.progress_reporter import ProgressReporter
from gpsd.kernel_distillation.kmeans import kmeans
from gpsd.kernel_distillation.nearest_inducing import nearest_inducing_points
from gpsd.progress import Callback

__all__ = ["InducingSelection", "select_inducing_points"]


@dataclasses.dataclass(frozen=True)
class InducingSelection:
    """What :func:`select_inducing_points` chose."""

    #: :math:`U`, shape ``(m, d)``, in the inputs' coordinates.
    inducing_points: Tensor
    #: :math:`J`, shape ``(n, b)``: the ``b`` nearest inducing points of every input, sorted by
    #: index within each row.
    neighbour_indices: Tensor
    #: Whether a callback asked to stop (the phases after it ran whole, without records).
    stopped: bool
    #: Seconds K-means took (about 0 for inducing points given).
    kmeans_seconds: float


def select_inducing_points(
    train_x: Tensor,
    num_inducing: int,
    sparsity: int,
    *,
    scale: Tensor,
    inducing_points: Tensor | None = None,
    kmeans_max_iter: int = 50,
    seed: int = 0,
    process_group: object = None,
    task: str,
    progress: object = False,
    callback: Callback | None = None,
) -> InducingSelection:
    r"""K-means centroids (unless ``inducing_points`` are given) and the nearest ``sparsity`` of
    them for every input, both searched on :math:`x / s`.

    Reports phase ``"k-means"`` of ``task`` (one record per Lloyd iteration, ``loss`` the mean
    squared distance to the assigned centroid, on the scaled inputs) and then ``"neighbours"``
    (one record, after the search). A callback returning ``True`` ends the K-means iterations
    with the centroids reached; the later phases then run whole without calling it. With a
    ``process_group``, every rank takes rank 0's centroids (on GPUs K-means adds with atomics
    whose order varies); the search is replicated.

    :param train_x: :math:`X`, shape ``(n, d)``.
    :param num_inducing: ``m``.
    :param sparsity: ``b <= m``.
    :param scale: :math:`s`, shape ``(d,)``.
    :param inducing_points: :math:`U`, shape ``(m, d)``, used as given (no K-means).
    :param kmeans_max_iter: the most Lloyd iterations.
    :param seed: seed of the k-means++ seeding.
    :param process_group: a ``torch.distributed.ProcessGroup`` or ``None``.
    :param task: the task named in the records.
    :param progress: ``False``, ``True`` or a ``tqdm`` bar.
    :param callback: ``None`` or a function of an :class:`~gpsd.IterationRecord`.
    """
    t0 = time.perf_counter()
    stopped = False
    if inducing_points is None:
        with ProgressReporter(task, kmeans_max_iter, progress, callback, phase="k-means") as report:
            centres = kmeans(
                train_x / scale,
                num_inducing,
                max_iter=kmeans_max_iter,
                seed=seed,
                callback=lambda r: report.update(r.iteration, loss=r.loss, **r.info),
            )
        stopped = report.stopped
        if stopped:  # the later phases run whole, without further records
            callback = None
        if process_group is not None:
            what = "all_gather of the K-means centroids"
            centres = all_gather(centres, process_group, what)[0]
        inducing_points = centres * scale
    kmeans_seconds = time.perf_counter() - t0
    with ProgressReporter(task, 1, progress, callback, phase="neighbours") as report:
        _, idx = nearest_inducing_points(train_x / scale, inducing_points / scale, sparsity)
        report.update(1)
    return InducingSelection(
        inducing_points=inducing_points,
        neighbour_indices=idx.sort(dim=-1).values,
        stopped=stopped or report.stopped,
        kmeans_seconds=kmeans_seconds,
    )
