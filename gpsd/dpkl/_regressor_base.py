"""Shared training / prediction loop of the DPKL-family GP regressors (private)."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Literal

import gpytorch
import torch
from gpytorch.utils.warnings import NumericalWarning
from torch import Tensor

from gpsd._internal.module_state import ModuleState, checked_setting
from gpsd._internal.validation import (
    as_float_tensor,
    check_finite,
    check_int,
    check_positive_float,
    replacement_data,
)
from gpsd.dpkl.svgd import (
    SteinVariationalGradient,
    check_bandwidth,
    check_repulsion,
    check_update,
)

__all__ = ["check_inputs", "EmbeddingGPRegressorBase"]


def check_inputs(
    x: object, name: str, num_features: int | None = None, like: Tensor | None = None
) -> Tensor:
    """``x`` as a finite ``(n, d)`` float tensor (with ``d == num_features`` if given)."""
    x = as_float_tensor(
        x,
        name,
        dtype=None if like is None else like.dtype,
        device=None if like is None else like.device,
    )
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape (n, d), got shape {tuple(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError(f"{name} must hold at least one row")
    if x.shape[1] < 1:
        raise ValueError(
            f"{name} must have at least one feature (column), got shape {tuple(x.shape)}"
        )
    if num_features is not None and x.shape[-1] != num_features:
        raise ValueError(
            f"{name} must have {num_features} features (as the training inputs), got {x.shape[-1]}"
        )
    return check_finite(x, name)


def check_targets(y: object, name: str, n: int, like: Tensor) -> Tensor:
    y = as_float_tensor(y, name, dtype=like.dtype, device=like.device)
    if y.dim() != 1 or y.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},), got shape {tuple(y.shape)}")
    return check_finite(y, name)


class EmbeddingGPRegressorBase(gpytorch.models.ExactGP):
    """An ExactGP with a constant mean, a Gaussian likelihood and a ``fit``/``predict`` loop.

    Subclasses set ``self.covar_module`` and may hold a particle ensemble whose stacked
    parameters (``self.particle_parameters()``) are stepped with a functional gradient.
    """

    _update: Literal["paper", "svgd"] = "paper"
    _repulsion: float | None = None
    _bandwidth: float | str = "median"

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        likelihood: gpytorch.likelihoods.GaussianLikelihood | None,
    ) -> None:
        train_x = check_inputs(train_x, "train_x")
        train_y = check_targets(train_y, "train_y", train_x.shape[0], train_x)
        if likelihood is None:
            likelihood = gpytorch.likelihoods.GaussianLikelihood()
        elif not isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood):
            raise TypeError(
                f"likelihood must be a gpytorch GaussianLikelihood, got {type(likelihood).__name__}"
            )
        likelihood = likelihood.to(train_x)
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()

    # ------------------------------------------------------------------ model
    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    def particle_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable stacked particle parameters (stepped by the functional gradient); may be
        empty. Frozen ones (``requires_grad=False``) are left out."""
        ensemble = getattr(self.covar_module, "feature_extractor", None)
        return [] if ensemble is None else [p for p in ensemble.parameters() if p.requires_grad]

    update = checked_setting(
        "update",
        check_update,
        """The particles' functional gradient in :meth:`fit`: ``"paper"`` or ``"svgd"``.""",
    )

    @property
    def repulsion(self) -> float:
        """The weight of the repulsive term in :meth:`fit`: the value set, or (when none is set,
        or after setting ``None``) 0 for ``update="paper"`` and 1 for ``update="svgd"``, read
        from the current :attr:`update`."""
        if self._repulsion is None:
            return 1.0 if self.update == "svgd" else 0.0
        return self._repulsion

    @repulsion.setter
    def repulsion(self, value: float | None) -> None:
        self._repulsion = None if value is None else check_repulsion(value)

    bandwidth = checked_setting(
        "bandwidth",
        check_bandwidth,
        """The Stein kernel bandwidth in :meth:`fit`: ``"median"`` or a positive float.""",
    )

    def training_loss(self) -> Tensor:
        r"""Negative log marginal likelihood per training point, :math:`\hat L / n`.

        It is computed from the GP prior at the training inputs (:meth:`forward`) in either
        mode, so it is the marginal likelihood also in evaluation mode (where calling a GPyTorch
        ``ExactGP`` at its training inputs would give the posterior instead). The feature
        extractor runs in the model's current mode: :meth:`fit` calls this in training mode
        (dropout on, BatchNorm normalising with the batch's statistics and updating its running
        ones); in evaluation mode the loss is deterministic.
        """
        return self._negative_mll(self.forward(self.train_inputs[0]))

    def _negative_mll(self, prior: gpytorch.distributions.MultivariateNormal) -> Tensor:
        r""":math:`\hat L / n` for the prior ``prior`` of the latent values at the training inputs."""
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(self.likelihood, self)
        return -mll(prior, self.train_targets)

    def set_train_data(
        self, inputs: Tensor | None = None, targets: Tensor | None = None, strict: bool = True
    ) -> None:
        """Replace the training inputs, targets or both (GPyTorch's ``ExactGP`` convention).

        They are checked as at construction: finite, ``inputs`` of shape ``(n, D)`` with the
        current number ``D`` of features, ``targets`` of shape ``(n,)``. With ``strict`` (the
        default, as in GPyTorch) they must have the current shape, dtype and device; with
        ``strict=False`` the number of points may change and they are converted to the model's
        dtype and device. The hyperparameters are not refitted; the next prediction uses the new
        data.

        :param inputs: New training inputs ``(n, D)`` (or a one-element tuple of them); ``None``
            keeps the current.
        :param targets: New targets ``(n,)``; ``None`` keeps the current.
        :param strict: Refuse a new shape, dtype or device.
        """
        train_x = self.train_inputs[0]
        x, y = replacement_data(inputs, targets, train_x, self.train_targets, strict)
        x = check_inputs(x, "inputs", train_x.shape[-1], like=train_x)
        y = check_targets(y, "targets", x.shape[0], train_x)
        super().set_train_data(x, y, strict=False)  # drops GPyTorch's prediction cache

    # ------------------------------------------------------------------ training
    def fit(
        self,
        num_steps: int = 200,
        lr: float = 1e-2,
        *,
        val_x: Tensor | None = None,
        val_y: Tensor | None = None,
        check_every: int = 10,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> dict[str, list[float]]:
        r"""Train with Adam; the particles follow the functional gradient (Algorithm 1).

        Every step: ``loss = self.training_loss()``; ``loss.backward()``; the particles' gradients
        of the total negative log marginal likelihood :math:`\hat L` (the per-point loss times
        :math:`n`, which sets the weight of the repulsive term) are transformed by
        :class:`~gpsd.dpkl.SteinVariationalGradient` with this model's :attr:`bandwidth` and
        :attr:`repulsion` (by default 0 for :attr:`update` ``"paper"``: Prop. 1; 1 for
        ``"svgd"``: SVGD), read when ``fit`` is called;
        the result is divided by :math:`n` again so that all gradients are on the per-point
        scale; the GP hyperparameters keep their ordinary gradient; then ``optimizer.step()``.

        With ``val_x``/``val_y`` the per-point Gaussian predictive NLL on them is checked every
        ``check_every`` steps (and at the end) and the best state is restored (early stopping).

        Returns a history with ``"loss"`` per step and ``"val_nll"`` per check.
        """
        num_steps = check_int(num_steps, "num_steps", minimum=0)
        lr = check_positive_float(lr, "lr")
        if (val_x is None) != (val_y is None):
            raise ValueError("val_x and val_y must be given together")
        check_every = check_int(check_every, "check_every")
        train_x = self.train_inputs[0]
        if val_x is not None:
            val_x = check_inputs(val_x, "val_x", train_x.shape[-1], like=train_x)
            val_y = check_targets(val_y, "val_y", val_x.shape[0], train_x)
        if optimizer is None:
            optimizer = torch.optim.Adam(self.parameters(), lr=lr)
        particles = self.particle_parameters()
        transform = None
        if particles:
            transform = SteinVariationalGradient(
                particles, bandwidth=self.bandwidth, repulsion=self.repulsion, loss_type="joint"
            )
        n = train_x.shape[0]
        history: dict[str, list[float]] = {"loss": [], "val_nll": []}
        best_state, best_val = None, math.inf

        def check() -> None:
            nonlocal best_state, best_val
            val = self.nll(val_x, val_y)
            history["val_nll"].append(val)
            if val < best_val:
                best_val, best_state = val, copy.deepcopy(self.state_dict())

        self.train()
        for step in range(num_steps):
            if val_x is not None and step % check_every == 0:
                check()
                self.train()
            optimizer.zero_grad(set_to_none=True)
            loss = self.training_loss()
            if not torch.isfinite(loss):
                raise RuntimeError(
                    f"the training loss became {float(loss)} at step {step}; lower lr or check data"
                )
            loss.backward()
            if transform is not None:
                with torch.no_grad():
                    for p in particles:
                        if p.grad is not None:
                            p.grad.mul_(n)  # gradient of the total NLL L-hat
                transform.transform_()
                with torch.no_grad():
                    for p in particles:
                        p.grad.div_(n)  # back to the per-point scale of the other gradients
            optimizer.step()
            history["loss"].append(float(loss.detach()))
        if val_x is not None:
            check()
            if best_state is not None:
                self.load_state_dict(best_state)
        self.eval()
        return history

    # ------------------------------------------------------------------ prediction
    @torch.no_grad()
    def predict(self, x: Tensor, *, include_noise: bool = True) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance at ``x`` (of ``y`` with the noise, or of ``f`` without).

        ``x`` (any array-like) is converted to the training inputs' dtype and device.

        Unlike a plain :class:`~gpytorch.models.ExactGP` in evaluation mode, which keeps the
        prediction cache it built first, this notices any change of the parameters or buffers
        since (a hyperparameter set by hand, resampled random features, ``load_state_dict``)
        and predicts with the current values.
        """
        train_x = self.train_inputs[0]
        x = check_inputs(x, "x", train_x.shape[-1], like=train_x)
        was_training = self.training
        self.eval()
        self._drop_stale_prediction_cache()
        try:
            f = self(x)
            out = self.likelihood(f) if include_noise else f
            mean, var = out.mean, out.variance
        finally:
            self.train(was_training)
        if not (torch.isfinite(mean).all() and torch.isfinite(var).all()):
            raise RuntimeError("non-finite predictions; the model is numerically unstable")
        if (var <= 0).any():
            warnings.warn(
                "non-positive predictive variances were clamped to 1e-12",
                NumericalWarning,
                stacklevel=2,
            )
            var = var.clamp_min(1e-12)
        return mean, var

    def _drop_stale_prediction_cache(self) -> None:
        """Forget GPyTorch's prediction cache if the state changed since it was built."""
        built = getattr(self, "_prediction_cache_state", None)
        if self.prediction_strategy is None or built is None or not built.matches(self):
            self.prediction_strategy = None
            self._prediction_cache_state = ModuleState(self)

    def nll(self, x: Tensor, y: Tensor) -> float:
        r"""Mean per-point Gaussian NLL, :math:`\tfrac{(y-\mu)^2}{2\sigma^2} + \tfrac12\log 2\pi\sigma^2`.

        :math:`\mu, \sigma^2` are the predictive mean and variance of :math:`y` (noise included).
        """
        mean, var = self.predict(x)
        y = check_targets(y, "y", mean.shape[0], mean)
        return float((0.5 * (y - mean).pow(2) / var + 0.5 * torch.log(2 * math.pi * var)).mean())

    def rmse(self, x: Tensor, y: Tensor) -> float:
        """Root mean squared error of the predictive mean at ``x``."""
        mean, _ = self.predict(x)
        y = check_targets(y, "y", mean.shape[0], mean)
        return float((y - mean).pow(2).mean().sqrt())
