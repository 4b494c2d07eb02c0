"""Progress bars and callbacks: one way for every loop gpsd runs.

Every method that iterates (training a DPKL model, kernel distillation's descent, fitting the GPC
distillers, ``optimize_hyperparameters``, growing a Lanczos basis) takes two keywords:

``progress``
    ``False`` (default): silent. ``True``: a ``tqdm`` bar on standard error. A ``tqdm`` instance
    (``tqdm.auto.tqdm(...)``, a notebook bar): that bar is advanced, and left open for the caller.

``callback``
    ``None``, or a function called after every iteration with one :class:`IterationRecord`.
    A fit with several phases (``DPKLRegressor.fit``: the ARD warm start, the training, then
    the refit on all rows) reports the iterations of every phase, each record naming its phase.
    **It stops the loop early by returning** ``True``; any other return value (``None``
    included) lets it go on. The estimator then keeps what the loop reached, as after its last
    iteration.

gpsd never prints: warnings go through :mod:`warnings`, progress through ``tqdm``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Callback", "IterationRecord"]


@dataclass(frozen=True)
class IterationRecord:
    """What a callback receives after one iteration.

    :param task: What iterates, as ``"ClassName.method"`` (``"DPKLRegressor.fit"``).
    :param iteration: The iteration just finished, counted from 1.
    :param total: The most iterations the loop will run (``None`` where unknown).
    :param loss: The objective after the iteration, where the loop has one (else ``None``).
    :param info: Other numbers of the iteration (a validation loss, a step size, a rank).
    :param phase: The phase of the fit the iteration belongs to, for fits with several
        (``"warm start"``, ``"training"``, ``"refit warm start"``, ``"refit training"``); ``None`` for one-phase loops. ``iteration`` and
        ``total`` count within the phase.
    """

    task: str
    iteration: int
    total: int | None = None
    loss: float | None = None
    info: Mapping[str, float] = field(default_factory=dict)
    phase: str | None = None


#: A callback's type: called with each record; returning ``True`` stops the loop.
Callback = Callable[[IterationRecord], Any]
