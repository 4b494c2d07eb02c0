"""Shared training / prediction loop of the DPKL-family GP regressors (private)."""

from __future__ import annotations

import copy
import math
from typing import Literal

import gpytorch
import torch
from gpytorch.utils.warnings import NumericalWarning
from torch import Tensor, nn

from gpsd._internal.fitted import FitDependencies, FitRecord, fit_records
from gpsd._internal.module_state import checked_setting
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.user_warning import warn
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
from gpsd.exceptions import NonFiniteEmbeddingsError, NotFittedError
from gpsd.prediction import Prediction
from gpsd.progress import Callback

__all__ = ["check_inputs", "EmbeddingGPRegressorBase"]


def check_inputs(
    x: object, name: str, num_features: int | None = None, like: Tensor | None = None
) -> Tensor:
    """``x`` as a finite ``(n, d)`` float tensor (with ``d == num_features`` if given); a 1-D
    ``x`` of shape ``(n,)`` is read as ``n`` inputs of one feature."""
    x = as_float_tensor(
        x,
        name,
        dtype=None if like is None else like.dtype,
        device=None if like is None else like.device,
    )
    if x.dim() == 1:
        x = x.unsqueeze(-1)
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape (n, d) or (n,), got shape {tuple(x.shape)}")
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


def _mark_fitted(module: nn.Module, incompatible_keys: object) -> None:
    """``load_state_dict`` post-hook: a model given a state is fitted."""
    module._fitted = True


class EmbeddingGPRegressorBase(gpytorch.models.ExactGP):
    """An ExactGP with a Gaussian likelihood and a ``fit``/``predict`` loop.

    Subclasses set ``self.covar_module`` and may hold a particle ensemble whose stacked
    parameters (``self.particle_parameters()``) are stepped with a functional gradient.

    A model is fitted by :meth:`fit`, or by ``load_state_dict`` (a trained state); before that,
    :meth:`predict`, :meth:`nll`, :meth:`rmse` and ``model(test_x)`` in evaluation mode raise
    :class:`~gpsd.NotFittedError`.
    """

    _update: Literal["paper", "svgd"] = "paper"
    _repulsion: float | None = None
    _bandwidth: float | str = "median"

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        likelihood: gpytorch.likelihoods.GaussianLikelihood | None,
        mean_module: gpytorch.means.Mean | None = None,
    ) -> None:
        train_x = check_inputs(train_x, "train_x")
        train_y = check_targets(train_y, "train_y", train_x.shape[0], train_x)
        if likelihood is None:
            likelihood = gpytorch.likelihoods.GaussianLikelihood()
        elif not isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood):
            raise TypeError(
                f"likelihood must be a gpytorch GaussianLikelihood, got {type(likelihood).__name__}"
            )
        if mean_module is None:
            mean_module = gpytorch.means.ConstantMean()
        elif not isinstance(mean_module, gpytorch.means.Mean):
            raise TypeError(
                f"mean_module must be a gpytorch.means.Mean or None, got {type(mean_module).__name__}"
            )
        likelihood = likelihood.to(train_x)
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = mean_module.to(train_x)
        self._fitted = False
        #: The record of the last :meth:`fit`: ``"loss"``, the training loss of each iteration;
        #: ``"val_nll"``, the validation NLL of each check; ``"val_iteration"``, the iteration
        #: after which each check was made (0: before the first). Empty lists before ``fit``.
        self.history: dict[str, list[float]] = {"loss": [], "val_nll": [], "val_iteration": []}
        self.register_load_state_dict_post_hook(_mark_fitted)

    # ------------------------------------------------------------------ model
    def forward(self, x: Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    def __call__(self, *inputs: Tensor, **kwargs):
        """GPyTorch's ``ExactGP`` call: in evaluation mode, ``model(test_x)`` is the posterior
        ``MultivariateNormal`` of the latent function at ``test_x`` (``(M, d)``, or ``(M,)`` for
        one feature), from the current parameters (a change since the last call is noticed); it
        raises :class:`~gpsd.NotFittedError` before :meth:`fit`. In training mode it is the prior
        at the training inputs."""
        if self.training or gpytorch.settings.prior_mode.on():
            return super().__call__(*inputs, **kwargs)
        self._check_fitted("model(test_x)")
        train_x = self.train_inputs[0]
        inputs = tuple(check_inputs(x, "test_x", train_x.shape[-1], like=train_x) for x in inputs)
        self._refresh_prediction_cache()
        return super().__call__(*inputs, **kwargs)

    def _check_fitted(self, what: str) -> None:
        if not self._fitted:
            raise NotFittedError(
                f"{type(self).__name__} is not fitted: call fit() (or load_state_dict() with a "
                f"trained state) before {what}"
            )

    def _refresh_prediction_cache(self) -> None:
        """Forget GPyTorch's prediction cache if anything it is built from changed since it was
        last forgotten (the parameters and buffers, :mod:`gpsd.settings`: the rules of
        :class:`~gpsd._internal.fitted.Fitted`), or if it may carry an autograd graph (grad
        mode). Copies and pickles of the model forget it on first use."""
        records = fit_records(self)
        dependencies = FitDependencies((self,))
        record = records.get("prediction strategy")
        if torch.is_grad_enabled() or record is None or not record.valid(dependencies):
            self.prediction_strategy = None
            records["prediction strategy"] = FitRecord(dependencies, None, False)

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

        They are checked as at construction: finite, ``inputs`` of shape ``(n, D)`` (or ``(n,)``
        for ``D = 1``) with the current number ``D`` of features, ``targets`` of shape ``(n,)``.
        With ``strict`` (the default, as in GPyTorch) they must have the current shape, dtype and
        device; with ``strict=False`` the number of points may change and they are converted to
        the model's dtype and device. The hyperparameters are not refitted; the next prediction
        uses the new data.

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
        *,
        max_iter: int = 200,
        lr: float = 1e-2,
        val_x: Tensor | None = None,
        val_y: Tensor | None = None,
        check_every: int = 10,
        optimizer: torch.optim.Optimizer | None = None,
        progress: object = False,
        callback: Callback | None = None,
    ) -> EmbeddingGPRegressorBase:
        r"""Train with Adam; the particles follow the functional gradient (Algorithm 1).

        Every iteration: ``loss = self.training_loss()``; ``loss.backward()``; the particles'
        gradients of the total negative log marginal likelihood :math:`\hat L` (the per-point
        loss times :math:`n`, which sets the weight of the repulsive term) are transformed by
        :class:`~gpsd.dpkl.SteinVariationalGradient` with this model's :attr:`bandwidth` and
        :attr:`repulsion` (by default 0 for :attr:`update` ``"paper"``: Prop. 1; 1 for
        ``"svgd"``: SVGD), read when ``fit`` is called; the result is divided by :math:`n` again
        so that all gradients are on the per-point scale; the GP hyperparameters keep their
        ordinary gradient; then ``optimizer.step()``.

        With ``val_x``/``val_y`` the per-point Gaussian predictive NLL on them (noise included,
        :meth:`nll`) is checked before the first iteration, after every ``check_every``
        iterations and after the last, and the best checked state is restored at the end (early
        stopping), also when a callback stops training.

        What was recorded is kept in :attr:`history`: ``"loss"`` per iteration, ``"val_nll"``
        per check and ``"val_iteration"``, the iteration after which each check was made.

        :param max_iter: Iterations (optimiser steps) to run, ``>= 0``.
        :param lr: Adam's learning rate (unused with ``optimizer``).
        :param val_x: ``(n_v, D)`` validation inputs (with ``val_y``), or ``None``.
        :param val_y: ``(n_v,)`` validation targets.
        :param check_every: Iterations between validation checks.
        :param optimizer: An optimiser over this model's parameters (default: Adam).
        :param progress: ``True`` for a ``tqdm`` bar, or a bar of your own (:mod:`gpsd.progress`).
        :param callback: Called after each iteration with an :class:`~gpsd.IterationRecord`
            (``loss``: the training loss; ``info["val_nll"]`` on iterations with a check);
            returning ``True`` stops training.
        :returns: ``self``, fitted and in evaluation mode.
        :raises ValueError: the feature extractor produced NaN or inf embeddings (the message
            names the iteration).
        """
        check_progress(progress, callback)
        max_iter = check_int(max_iter, "max_iter", minimum=0)
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
        reporter = ProgressReporter(f"{type(self).__name__}.fit", max_iter, progress, callback)
        return self._fit_loop(max_iter, val_x, val_y, check_every, optimizer, reporter)

    def _fit_loop(
        self,
        max_iter: int,
        val_x: Tensor | None,
        val_y: Tensor | None,
        check_every: int,
        optimizer: torch.optim.Optimizer,
        reporter: ProgressReporter,
    ) -> EmbeddingGPRegressorBase:
        """The loop of :meth:`fit` on checked arguments, reporting each iteration to
        ``reporter``."""
        train_x = self.train_inputs[0]
        particles = self.particle_parameters()
        transform = None
        if particles:
            transform = SteinVariationalGradient(
                particles, bandwidth=self.bandwidth, repulsion=self.repulsion, loss_type="joint"
            )
        n = train_x.shape[0]
        history: dict[str, list[float]] = {"loss": [], "val_nll": [], "val_iteration": []}
        self.history = history
        best_state, best_val = None, math.inf

        def check(iteration: int) -> float:
            nonlocal best_state, best_val
            was_fitted, self._fitted = self._fitted, True  # nll predicts from the current state
            try:
                val = self.nll(val_x, val_y)
            finally:
                self._fitted = was_fitted
                self.train()
            history["val_nll"].append(val)
            history["val_iteration"].append(iteration)
            if val < best_val:
                best_val, best_state = val, copy.deepcopy(self.state_dict())
            return val

        self.train()
        if val_x is not None:
            check(0)
        iteration = 0
        with reporter:
            for iteration in range(1, max_iter + 1):
                optimizer.zero_grad(set_to_none=True)
                try:
                    loss = self.training_loss()
                except NonFiniteEmbeddingsError as err:
                    raise NonFiniteEmbeddingsError(
                        f"{err} (in fit, at iteration {iteration})"
                    ) from err
                if not torch.isfinite(loss):
                    raise RuntimeError(
                        f"the training loss became {float(loss)} at iteration {iteration}; "
                        "lower lr or check the data"
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
                info = {}
                if val_x is not None and (iteration % check_every == 0 or iteration == max_iter):
                    info["val_nll"] = check(iteration)
                if reporter.update(iteration, loss=history["loss"][-1], **info):
                    break
        if val_x is not None:
            if history["val_iteration"][-1] != iteration:  # stopped by the callback
                check(iteration)
            self.load_state_dict(best_state)
        self._fitted = True
        self.eval()
        return self

    # ------------------------------------------------------------------ prediction
    @torch.no_grad()
    def predict(self, test_x: Tensor, *, include_noise: bool = False) -> Prediction:
        """The posterior of the latent function at ``test_x`` (of the observations with
        ``include_noise=True``): a :class:`~gpsd.Prediction` with ``mean`` and ``variance`` of
        shape ``(M,)``.

        ``test_x`` (``(M, D)``, or ``(M,)`` for ``D = 1``; any array-like) is converted to the
        training inputs' dtype and device. The feature extractor runs in evaluation mode (no
        dropout; BatchNorm's running statistics), whatever mode the model is in.

        Unlike a plain :class:`~gpytorch.models.ExactGP` in evaluation mode, which keeps the
        prediction cache it built first, this notices any change of the parameters or buffers
        since (a hyperparameter set by hand, resampled random features, ``load_state_dict``)
        and predicts with the current values.

        :raises ~gpsd.NotFittedError: before :meth:`fit`.
        """
        self._check_fitted("predict()")
        train_x = self.train_inputs[0]
        x = check_inputs(test_x, "test_x", train_x.shape[-1], like=train_x)
        was_training = self.training
        self.eval()
        try:
            f = self(x)
            out = self.likelihood(f) if include_noise else f
            mean, var = out.mean, out.variance
        finally:
            self.train(was_training)
        if not (torch.isfinite(mean).all() and torch.isfinite(var).all()):
            raise RuntimeError("non-finite predictions; the model is numerically unstable")
        if (var <= 0).any():
            warn(
                "non-positive predictive variances were clamped to 1e-12",
                NumericalWarning,
            )
            var = var.clamp_min(1e-12)
        return Prediction(mean, var)

    def nll(self, x: Tensor, y: Tensor) -> float:
        r"""Mean per-point Gaussian NLL, :math:`\tfrac{(y-\mu)^2}{2\sigma^2} + \tfrac12\log 2\pi\sigma^2`.

        :math:`\mu, \sigma^2` are the predictive mean and variance of :math:`y` (noise included).
        """
        pred = self.predict(x, include_noise=True)
        mean, var = pred.mean, pred.variance
        y = check_targets(y, "y", mean.shape[0], mean)
        return float((0.5 * (y - mean).pow(2) / var + 0.5 * torch.log(2 * math.pi * var)).mean())

    def rmse(self, x: Tensor, y: Tensor) -> float:
        """Root mean squared error of the predictive mean at ``x``."""
        mean = self.predict(x).mean
        y = check_targets(y, "y", mean.shape[0], mean)
        return float((y - mean).pow(2).mean().sqrt())
