"""Functional (Stein variational) gradient transform for particle parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor

from gpsd._internal.distances import squared_distances
from gpsd._internal.validation import check_positive_float

__all__ = ["SteinVariationalGradient"]


class SteinVariationalGradient:
    r"""Rewrite the ``.grad`` of stacked particle parameters into a functional-gradient direction.

    The parameters are tensors whose leading dimension indexes ``m`` particles (for example the
    parameters of a :class:`~gpsd.dpkl.ParticleEnsemble`); particle :math:`i` is the concatenation
    :math:`\mathbf{w}_i \in \mathbb{R}^P` of its slices. After ``loss.backward()`` the ``.grad``
    holds :math:`\mathbf{g}_l = \nabla_{\mathbf{w}_l} L` of a loss :math:`L` to *minimise*;
    :meth:`transform_` replaces it by

    .. math::

        \hat{\mathbf{g}}_i = c \sum_{l=1}^m \kappa(\mathbf{w}_l, \mathbf{w}_i)\, \mathbf{g}_l
            \;-\; \frac{\tau}{m} \sum_{l=1}^m
            \nabla_{\mathbf{w}_l} \kappa(\mathbf{w}_l, \mathbf{w}_i),
        \qquad
        \kappa(\mathbf{w}, \mathbf{w}') =
            \exp\!\left(-\lVert \mathbf{w} - \mathbf{w}' \rVert^2 / h\right),

    so that an ordinary optimiser step :math:`\mathbf{w}_i \leftarrow \mathbf{w}_i -
    \epsilon \hat{\mathbf{g}}_i` follows the functional gradient. The conventions:

    * ``loss_type="joint"`` (:math:`c = 1`): :math:`L = \hat{L}(\mathbf{w}_1, \dots, \mathbf{w}_m)`
      is one loss of the whole ensemble (DPKL's empirical negative log likelihood, whose partial
      gradients are :math:`O(1/m)`). With ``repulsion=0`` this is Algorithm 1 / Prop. 1 of
      Mallick et al.; with ``repulsion=1`` it is exactly SVGD (Liu & Wang, 2016) with the score
      :math:`-m \nabla_{\mathbf{w}_l} \hat{L}` of the target :math:`\propto e^{-m \hat L}`.
    * ``loss_type="per_particle"`` (:math:`c = 1/m`): :math:`L = \sum_l U(\mathbf{w}_l)` with
      :math:`U = -\log p` an unnormalised negative log density, so :math:`\mathbf{g}_l =
      \nabla U(\mathbf{w}_l)`; with ``repulsion=1`` this is SVGD for :math:`p` exactly.

    The repulsive term is :math:`-\nabla_{\mathbf{w}_l}\kappa(\mathbf{w}_l, \mathbf{w}_i) =
    \tfrac{2}{h} (\mathbf{w}_l - \mathbf{w}_i)\,\kappa(\mathbf{w}_l, \mathbf{w}_i)`, which pushes
    particle :math:`i` away from its neighbours.

    Bandwidth: ``bandwidth="median"`` uses :math:`h = \operatorname{med}^2 / \log m`, where
    :math:`\operatorname{med}^2` is the median of the *squared* Euclidean distances over the
    :math:`m(m-1)/2` distinct particle pairs (the mean of the two middle values when their number
    is even). This is the convention of Liu & Wang (2016), whose kernel is
    :math:`\exp(-\lVert\cdot\rVert^2/h)` with :math:`h = \mathrm{med}^2/\log m`; it makes
    :math:`\kappa = 1/m` at the median distance. (Their public code differs slightly: it
    includes the zero diagonal in the median and uses :math:`\log(m+1)`.)
    For ``m = 1`` or coincident particles :math:`h = 1` is used (then :math:`\kappa \equiv 1` on the
    particles and the repulsion vanishes). A positive float fixes :math:`h`. :math:`h` is not
    differentiated.

    :param parameters: tensors with ``.grad``, each of shape ``(m, ...)`` with the same ``m``;
        those with ``requires_grad=False`` (frozen) are left alone by :meth:`transform_`, so
        ``ensemble.parameters()`` may be passed whole.
    :param bandwidth: ``"median"`` or a fixed positive :math:`h`.
    :param repulsion: the weight :math:`\tau \ge 0` of the repulsive term (0: the paper's update).
    :param loss_type: ``"joint"`` or ``"per_particle"`` (see above).

    Example:

        >>> svgd = SteinVariationalGradient(ensemble.parameters(), repulsion=1.0)
        >>> loss.backward(); svgd.transform_(); optimizer.step()
    """

    def __init__(
        self,
        parameters: Iterable[Tensor],
        *,
        bandwidth: float | Literal["median"] = "median",
        repulsion: float = 0.0,
        loss_type: Literal["joint", "per_particle"] = "joint",
    ) -> None:
        params = list(parameters)
        if not params:
            raise ValueError("parameters must hold at least one tensor")
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
            if p.dim() < 1:
                raise ValueError("every parameter needs a leading particle dimension, got a scalar")
        m = params[0].shape[0]
        if any(p.shape[0] != m for p in params):
            raise ValueError(
                "all parameters must share the leading particle dimension, got "
                f"{[tuple(p.shape) for p in params]}"
            )
        bandwidth = check_bandwidth(bandwidth)
        repulsion = check_repulsion(repulsion)
        if loss_type not in ("joint", "per_particle"):
            raise ValueError(f"loss_type must be 'joint' or 'per_particle', got {loss_type!r}")
        self.parameters = params
        self.num_particles = int(m)
        self.bandwidth = bandwidth
        self.repulsion = repulsion
        self.loss_type = loss_type

    @staticmethod
    def median_bandwidth(flat: Tensor) -> Tensor:
        r""":math:`h = \operatorname{med}^2/\log m` of particles ``flat`` of shape ``(m, P)``."""
        m = flat.shape[0]
        if m < 2:
            return flat.new_tensor(1.0)
        sq = squared_distances(flat, flat)
        iu = torch.triu_indices(m, m, offset=1, device=flat.device)
        pairs = sq[iu[0], iu[1]]
        if pairs.dtype not in (torch.float32, torch.float64):
            pairs = pairs.float()  # torch.quantile takes neither float16 nor bfloat16
        med_sq = torch.quantile(pairs, 0.5)  # mean of the two middles if even
        if not med_sq > 0:
            return flat.new_tensor(1.0)
        return (med_sq / math.log(m)).to(flat.dtype)

    def direction(self, flat_params: Tensor, flat_grads: Tensor) -> Tensor:
        r"""Transformed gradients :math:`\hat{\mathbf{g}}` for ``(m, P)`` particles and grads."""
        m = flat_params.shape[0]
        w = flat_params.detach()
        h = self.median_bandwidth(w) if self.bandwidth == "median" else w.new_tensor(self.bandwidth)
        # Distances and the repulsion term are invariant to a common shift of the particles;
        # centred, neither loses the particles' spread to rounding far from the origin.
        w = w - w.mean(0)
        sq = squared_distances(w, w)
        kappa = torch.exp(-sq / h)  # shape: (m, m), symmetric; kappa[l, i] = kappa(w_l, w_i)
        scale = 1.0 if self.loss_type == "joint" else 1.0 / m
        out = scale * (kappa.mT @ flat_grads)  # sum_l kappa(w_l, w_i) g_l
        if self.repulsion > 0:
            # -(tau/m) sum_l grad_{w_l} kappa(w_l, w_i) = (tau/m)(2/h) sum_l kappa_li (w_l - w_i)
            rep = (kappa.mT @ w - kappa.sum(0).unsqueeze(-1) * w) * (2.0 / h)  # shape: (m, P)
            out = out + (self.repulsion / m) * rep
        return out

    @torch.no_grad()
    def transform_(self) -> None:
        """Overwrite the parameters' ``.grad`` (a missing ``.grad`` counts as zero) in place.

        Parameters with ``requires_grad=False`` (frozen) are skipped: their ``.grad`` is not
        written and they do not enter the distances between the particles.
        """
        m = self.num_particles
        params = [p for p in self.parameters if p.requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat_p = torch.cat([p.detach().reshape(m, -1) for p in params], -1)
        flat_g = torch.cat([g.reshape(m, -1) for g in grads], -1)
        if not torch.isfinite(flat_g).all():
            raise ValueError("the particle gradients hold NaN or infinite values")
        if not torch.isfinite(flat_p).all():  # NaN distances would make every direction NaN
            raise ValueError("the particle parameters hold NaN or infinite values")
        new = self.direction(flat_p, flat_g)
        offset = 0
        for p in params:
            k = p[0].numel()
            chunk = new[:, offset : offset + k].reshape(p.shape)
            offset += k
            if p.grad is None:  # in the parameter's dtype: mixed dtypes are promoted in new
                p.grad = chunk.to(dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(chunk)


def check_bandwidth(bandwidth: object) -> float | str:
    """``bandwidth`` as ``"median"`` or a positive finite ``float``, or a ``ValueError``.

    Any real scalar is a number here (a NumPy scalar, a one-element tensor), as for the other
    numeric arguments of gpsd.
    """
    if isinstance(bandwidth, str) and bandwidth == "median":
        return bandwidth
    try:
        return check_positive_float(bandwidth, "bandwidth")
    except ValueError:
        raise ValueError(
            f"bandwidth must be 'median' or a positive float, got {bandwidth!r}"
        ) from None


def check_repulsion(repulsion: object) -> float:
    """``repulsion`` (any real scalar) as a finite ``float >= 0``, or a ``ValueError``."""
    return check_positive_float(repulsion, "repulsion", allow_zero=True)


def check_update(update: object) -> str:
    """``update`` if it is ``"paper"`` or ``"svgd"``, else a ``ValueError``."""
    if not (isinstance(update, str) and update in ("paper", "svgd")):
        raise ValueError(f"update must be 'paper' or 'svgd', got {update!r}")
    return update
