"""The training data of the Laplace classifiers: checked at construction and on replacement.

Public so that every binary GP classifier (:class:`~gpsd.LaplaceGPClassifier` and the GPC
self-distillers) checks and replaces its data the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpsd._internal.validation import (
    as_float_tensor,
    check_matrix,
    check_same_device,
    check_vector,
    replacement_data,
)
from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms

__all__ = ["ClassificationTrainingData", "checked_classification_data"]


def checked_classification_data(
    train_x: object, train_y: object, terms: LaplaceLikelihoodTerms, like: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``train_x`` as ``(*b, n, d)`` (a 1-D tensor is ``(n, 1)``, ``n >= 1``) and ``train_y`` as
    ``(*b, n)`` in its dtype (float32 or float64: a ``TypeError`` otherwise), both finite, detached and on one device, ``train_y`` in the support
    of ``terms``; with ``like``, in the dtype and on the device of ``like``.

    Detached: a graph into (say) a feature extractor would be stored in the buffers, and every
    backward pass of the marginal likelihood would run into it.
    """
    where = {} if like is None else {"dtype": like.dtype}
    train_x = as_float_tensor(train_x, "train_x", **where)
    if train_x.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"train_x must be float32 or float64 (the Laplace fit factorises in its dtype), "
            f"got {train_x.dtype}; convert it with .double() or .float()"
        )
    train_x = check_matrix(train_x, "train_x", nonempty=True).detach()
    if like is not None:
        check_same_device(like, train_x, "train_x", "the model")
    train_y = as_float_tensor(train_y, "train_y", dtype=train_x.dtype).detach()
    check_same_device(train_x, train_y, "train_y", "train_x")
    check_vector(train_y, "train_y", n=train_x.shape[-2])
    terms.check_targets(train_y, "train_y")
    return train_x, train_y


class ClassificationTrainingData:
    """A mixin giving a binary GP classifier with ``train_inputs`` and ``train_targets`` buffers
    ``set_train_data``, which checks replacements as the constructor does
    (:func:`checked_classification_data`); the targets are checked against the classifier's
    likelihood terms (its ``terms`` attribute unless it overrides ``_target_terms``)."""

    @property
    def _target_terms(self) -> LaplaceLikelihoodTerms:
        """The likelihood terms whose ``check_targets`` the training targets pass."""
        return self.terms

    def set_train_data(
        self, inputs: Tensor | None = None, targets: Tensor | None = None, strict: bool = True
    ) -> None:
        """Replace the training inputs, targets or both (GPyTorch's ``ExactGP`` convention).

        They are checked as at construction. With ``strict`` (the default, as in GPyTorch) they
        must have the current shape, dtype and device; with ``strict=False`` the number of points
        and the batch shape may change and they are converted to the model's dtype (they must
        still be on its device). The next prediction refits.

        :param inputs: New training inputs ``(*b, n, d)`` or ``(n,)`` (or a one-element tuple of
            them); ``None`` keeps the current.
        :param targets: New targets ``(*b, n)``; ``None`` keeps the current.
        :param strict: Refuse a new shape, dtype or device.
        """
        x, y = replacement_data(inputs, targets, self.train_inputs, self.train_targets, strict)
        x, y = checked_classification_data(x, y, self._target_terms, like=self.train_inputs)
        self.train_inputs, self.train_targets = x, y
