"""The outer x inner grid of steps of a combined chain, counted by one flat step index."""

from __future__ import annotations

import torch
from torch import Tensor

from gpsd._internal.validation import as_float_tensor, check_int

__all__ = ["StepGrid", "noise_grid_schedule"]


class StepGrid:
    r"""The :math:`O \times I` steps of a combined chain (a mixin of a
    :class:`~gpsd.distillation._step_distiller.StepDistiller`): step :math:`(o, i)` is the flat
    step :math:`t = (o - 1) I + i`, counted from 1, on the step axis of every per-step tensor.

    The owner sets ``_outer_steps`` and ``_inner_steps`` before its noise schedule ``(*s, T)``.
    """

    _outer_steps: int
    _inner_steps: int
    num_steps: int
    noise: Tensor

    @property
    def outer_steps(self) -> int:
        """:math:`O`, the distribution-centric (outer) steps."""
        return self._outer_steps

    @property
    def inner_steps(self) -> int:
        """:math:`I`, the data-centric (inner) steps of every outer step."""
        return self._inner_steps

    @property
    def noise_grid(self) -> Tensor:
        r""":math:`\gamma_{o,i}` as the grid ``(*s, O, I)`` (a view of :attr:`noise`, ``(*s, T)``)."""
        return self.noise.unflatten(-1, (self.outer_steps, self.inner_steps))

    def flat_step(self, outer: int, inner: int) -> int:
        """The flat step :math:`t = (o - 1) I + i` of outer step ``outer`` and inner step
        ``inner`` (both counted from 1)."""
        outer, inner = check_int(outer, "outer"), check_int(inner, "inner")
        if outer > self.outer_steps or inner > self.inner_steps:
            raise ValueError(
                f"outer must lie in 1..{self.outer_steps} and inner in 1..{self.inner_steps}, "
                f"got outer={outer}, inner={inner}"
            )
        return (outer - 1) * self.inner_steps + inner

    def grid_step(self, step: int | Tensor) -> tuple[int, int] | tuple[Tensor, Tensor]:
        """The ``(outer, inner)`` steps (counted from 1) of a flat ``step`` in ``1..T``, or of a
        long tensor of them (as :meth:`best_step` gives for a batch)."""
        if isinstance(step, Tensor) and step.dim() > 0:
            if step.is_floating_point() or bool(((step < 1) | (step > self.num_steps)).any()):
                raise ValueError(f"step must hold integers in 1..{self.num_steps} (T)")
            return (step - 1) // self.inner_steps + 1, (step - 1) % self.inner_steps + 1
        step = self._check_step(step)
        return (step - 1) // self.inner_steps + 1, (step - 1) % self.inner_steps + 1


def noise_grid_schedule(
    noise: object, like: Tensor, outer_steps: object, inner_steps: object
) -> tuple[Tensor, int, int]:
    """``noise`` as the flat schedule ``(*s, O * I)`` with ``O`` and ``I``: one value repeated
    over the grid (both counts given), or a grid ``(*s, O, I)`` matching the counts given."""
    dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
    noise = as_float_tensor(noise, "noise", dtype=dtype, device=like.device)
    outer_steps = check_int(outer_steps, "outer_steps", optional=True)
    inner_steps = check_int(inner_steps, "inner_steps", optional=True)
    if noise.dim() == 0:
        if outer_steps is None or inner_steps is None:
            raise ValueError(
                "give outer_steps and inner_steps with one value of noise, or noise as a grid "
                "of shape (*s, outer_steps, inner_steps)"
            )
        return noise.expand(outer_steps * inner_steps).clone(), outer_steps, inner_steps
    if noise.dim() < 2 or noise.shape[-2:].numel() == 0:
        raise ValueError(
            "noise must be one value or a grid of shape (*s, outer_steps, inner_steps), got "
            f"shape {tuple(noise.shape)}"
        )
    grid = (noise.shape[-2], noise.shape[-1])
    if (outer_steps or grid[0], inner_steps or grid[1]) != grid:
        raise ValueError(
            f"noise of shape {tuple(noise.shape)} is a grid of {grid[0]} outer by {grid[1]} "
            f"inner steps, but outer_steps={outer_steps} and inner_steps={inner_steps}; give one "
            "value of noise to repeat, or leave the counts out"
        )
    return noise.flatten(-2), grid[0], grid[1]
