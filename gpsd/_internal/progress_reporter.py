"""The reporter every gpsd loop uses for its ``progress=`` and ``callback=`` keywords
(:mod:`gpsd.progress` documents them)."""

from __future__ import annotations

import dataclasses

from gpsd.progress import Callback, IterationRecord


def check_progress(progress: object, callback: object) -> None:
    """Refuse a ``progress=`` or ``callback=`` argument outside :mod:`gpsd.progress`'s contract.

    Every public method that takes them calls this at its entry, so that a bad argument is
    refused on every path, also on those that run no loop (a direct factorisation, a cached fit).

    :raises TypeError: ``progress`` is not ``True``, ``False``, ``None`` or a ``tqdm`` bar (an
        object with ``update`` and ``set_postfix``), or ``callback`` is neither ``None`` nor
        callable.
    """
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    if progress is True or progress is False or progress is None:
        return
    if not (hasattr(progress, "update") and hasattr(progress, "set_postfix")):
        raise TypeError(
            f"progress must be True, False or a tqdm progress bar, got {type(progress).__name__}"
        )


class ProgressReporter:
    """Reports a loop's iterations to a progress bar and a callback.

    Used as a context manager around the loop; :meth:`update` after each iteration returns
    whether the callback asked to stop::

        with ProgressReporter("Model.fit", max_iter, progress, callback) as report:
            for i in range(1, max_iter + 1):
                loss = step()
                if report.update(i, loss=loss):
                    break

    :param task: The loop's name for records and the bar's label.
    :param total: The most iterations (``None`` where unknown).
    :param progress: ``False``, ``True`` or a ``tqdm`` instance (see the module docs).
    :param callback: ``None`` or a function of an :class:`IterationRecord`.
    :param phase: The phase of a fit with several, named in every record and on the bar.
    """

    def __init__(
        self,
        task: str,
        total: int | None,
        progress: object = False,
        callback: Callback | None = None,
        phase: str | None = None,
    ) -> None:
        check_progress(progress, callback)
        self.task = task
        self.total = total
        self.phase = phase
        self.callback = callback
        self._owns_bar = False
        self._bar = None
        if progress is True:
            from tqdm.auto import tqdm

            desc = task if phase is None else f"{task} ({phase})"
            self._bar = tqdm(total=total, desc=desc, leave=False)
            self._owns_bar = True
        elif progress is not False and progress is not None:
            self._bar = progress
        #: the last record reported (``None`` before the first)
        self.last: IterationRecord | None = None
        #: whether the callback stopped the loop
        self.stopped = False

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def update(self, iteration: int, loss: float | None = None, **info: float) -> bool:
        """Report iteration ``iteration`` (1-based); ``True`` if the callback asks to stop."""
        loss = None if loss is None else float(loss)
        record = IterationRecord(self.task, iteration, self.total, loss, dict(info), self.phase)
        self.last = record
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        if self.callback is not None and self.callback(record) is True:
            self.stopped = True
        return self.stopped

    def forward(self, phase: str) -> Callback | None:
        """A callback for an inner loop (a step's hyperparameter refit) that hands each of its
        records to this reporter's callback as this task's, in ``phase``; the callback's
        ``True`` stops the inner loop and marks this one :attr:`stopped`. ``None`` where this
        reporter has no callback."""
        if self.callback is None:
            return None

        def forward(record: IterationRecord) -> bool:
            record = dataclasses.replace(record, task=self.task, phase=phase)
            if self.callback(record) is True:
                self.stopped = True
            return self.stopped

        return forward

    def close(self) -> None:
        """Close the bar if this reporter made it."""
        if self._owns_bar and self._bar is not None:
            self._bar.close()
            self._bar = None
