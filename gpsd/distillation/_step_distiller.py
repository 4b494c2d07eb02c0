"""The base of every distiller: its steps, its noise schedule, the step axis and the choice of a
step."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import gpytorch
import torch
from torch import Tensor

from gpsd._internal.module_state import fixed_setting
from gpsd._internal.validation import as_float_tensor, check_int

__all__ = ["NoiseRule", "StepDistiller"]


@dataclass(frozen=True)
class NoiseRule:
    r"""What a family of distillers takes as its noise schedule :math:`\gamma_1, \dots, \gamma_T`.

    Every family takes a batch of schedules ``(*s, T)``; whether the batch fits the model's
    other batches is the family's :meth:`StepDistiller._check_noise_batch`.

    :param positive: Whether every value must be :math:`> 0` (else :math:`\ge 0`).
    :param why: Why the family needs :math:`\gamma > 0`, for the message (with ``positive``).
    :param steps_of_one_value: :math:`T` where one value is given without ``num_steps``.
    """

    positive: bool
    why: str = ""
    steps_of_one_value: int = 1


class StepDistiller(gpytorch.Module, abc.ABC):
    r"""A model distilled over steps :math:`t = 1, \dots, T`: the base of every distiller.

    It owns, once for every family: ``num_steps`` (:math:`T`, fixed at construction), the noise
    schedule ``noise`` of shape ``(*s, T)`` (for the families with one, :attr:`_noise_rule`:
    one value is every step's, and assignment is checked as construction and keeps :math:`T`),
    the check of a ``step`` argument (counted from 1), the accessor :meth:`step_targets` every
    family has, and :meth:`best_step`, whose criteria each family names in :attr:`_criteria`.
    Every per-step tensor (predictions, step targets, latent modes, scores) has its step axis
    after the batch, ``(*batch, T, ·)``, row ``t - 1`` for step ``t``; ``step=t`` drops it.

    A subclass calls :meth:`_init_steps` in its constructor, after ``gpytorch.Module``'s.
    """

    #: the family's rule for ``noise``; ``None`` for a family without a noise schedule
    _noise_rule: ClassVar[NoiseRule | None] = None
    #: the criteria of :meth:`best_step`, the first the default: the name of the method that
    #: scores every step, ``(*batch, T)``, and whether it scores validation data ``val_x, val_y``
    _criteria: ClassVar[dict[str, tuple[str, bool]]] = {}

    num_steps = fixed_setting(
        "num_steps", ":math:`T`, the number of distillation steps (fixed at construction)."
    )

    def _init_steps(
        self, num_steps: object, noise: object = None, like: Tensor | None = None
    ) -> None:
        """Set ``num_steps`` and, for a family with a noise schedule, the buffer ``noise``
        (checked by :meth:`_checked_noise` in ``like``'s dtype and on its device; without
        ``num_steps``, :math:`T` is the schedule's length)."""
        if self._noise_rule is None:
            self._num_steps = check_int(num_steps, "num_steps")
            return
        schedule = self._checked_noise(noise, like, num_steps)
        self._num_steps = schedule.shape[-1]
        self.register_buffer("noise", schedule)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "noise" and "noise" in self.__dict__.get("_buffers", {}):
            previous = self._buffers["noise"]
            value = self._checked_noise(value, previous, self.num_steps, assigned=True)
            super().__setattr__(name, value)
            try:
                self._check_noise_batch()
            except ValueError:
                super().__setattr__(name, previous)
                raise
            return
        super().__setattr__(name, value)

    def _check_noise_batch(self) -> None:
        """A ``ValueError`` unless the batch of the schedules fits the model's other batches
        (a family with a batch of schedules overrides it)."""

    def _checked_noise(
        self, noise: object, like: Tensor, num_steps: object = None, assigned: bool = False
    ) -> Tensor:
        r"""``noise`` as a detached schedule ``(*s, T)`` in ``like``'s dtype and on its device, by
        the family's :attr:`_noise_rule`: the one check of ``noise``, at construction and on
        assignment.

        One value (a number, or a 0-d tensor or array) is every step's: repeated ``num_steps``
        times (the rule's ``steps_of_one_value`` where ``num_steps`` is ``None``). A schedule must have ``num_steps``
        steps where ``num_steps`` is given; ``assigned`` says that it replaces the model's.
        """
        rule = self._noise_rule
        owner = type(self).__name__
        tensor = as_float_tensor(noise, "noise", dtype=like.dtype, device=like.device).detach()
        num_steps = check_int(num_steps, "num_steps", optional=True)
        if tensor.numel() == 0:
            raise ValueError("noise must hold at least one noise value, got an empty schedule")
        bound = "> 0" if rule.positive else ">= 0"
        valid = (tensor > 0) if rule.positive else (tensor >= 0)
        if not bool((torch.isfinite(tensor) & valid).all()):
            why = f" for {owner} ({rule.why})" if rule.positive and rule.why else ""
            raise ValueError(f"noise must hold finite numbers {bound}{why}, got {tensor.tolist()}")
        if tensor.dim() == 0:
            return tensor.reshape(1).expand(num_steps or rule.steps_of_one_value).clone()
        if num_steps is not None and tensor.shape[-1] != num_steps:
            fixed = (
                f" (num_steps is fixed once {owner} is built: build a new one to change it)"
                if assigned
                else ""
            )
            raise ValueError(
                f"num_steps={num_steps} does not match the {tensor.shape[-1]} steps of the noise "
                f"schedule (shape {tuple(tensor.shape)}); give one value of noise to repeat, or "
                f"a schedule of {num_steps} steps{fixed}"
            )
        return tensor

    def _check_step(self, step: object) -> int | None:
        """``step`` as an int in ``1..T`` (``None`` passes: every step), or a ``ValueError``."""
        if step is None:
            return None
        step = check_int(step, "step")
        if step > self.num_steps:
            raise ValueError(f"step must lie in 1..{self.num_steps} (num_steps), got {step}")
        return step

    @abc.abstractmethod
    def step_targets(self, step: int | None = None) -> Tensor:
        """The targets each step is fitted to, ``(*batch, T, N)`` with row ``t - 1`` for step
        ``t`` (or ``(*batch, N)`` for ``step=t``)."""

    def best_step(
        self,
        criterion: str | None = None,
        *,
        val_x: Tensor | None = None,
        val_y: Tensor | None = None,
    ) -> int | Tensor:
        """The step with the smallest score, counted from 1.

        :param criterion: One of the family's criteria (default: its first): the regression
            distillers take ``"gcv"`` (:meth:`~gpsd.DataCentricGPR.gcv`, on the training data;
            the default) and ``"validation"`` (:meth:`~gpsd.DataCentricGPR.validation_mse` on
            ``val_x, val_y``), the classifiers ``"validation"``
            (:meth:`~gpsd.DataCentricGPC.validation_log_loss` on ``val_x, val_y``).
        :param val_x: Validation inputs (the criteria that score validation data only).
        :param val_y: Validation targets (likewise).
        :return: An ``int`` in ``1..T``; for a batch, a ``long`` tensor of steps ``(*batch,)``.
        """
        names = tuple(self._criteria)
        criterion = names[0] if criterion is None else criterion
        if criterion not in self._criteria:
            raise ValueError(f"criterion must be one of {names}, got {criterion!r}")
        method, validates = self._criteria[criterion]
        if not validates:
            if val_x is not None or val_y is not None:
                raise ValueError(
                    f"val_x and val_y are used with criterion='validation' only; "
                    f"criterion={criterion!r} scores the training data"
                )
            scores = getattr(self, method)()
        else:
            if val_x is None or val_y is None:
                raise ValueError(f"criterion={criterion!r} needs val_x and val_y")
            scores = getattr(self, method)(val_x, val_y)
        best = scores.detach().argmin(dim=-1) + 1  # shape: (*batch,)
        return int(best) if best.dim() == 0 else best
