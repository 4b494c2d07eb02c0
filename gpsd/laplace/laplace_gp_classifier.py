r"""Binary GP classification by the Laplace approximation, for any GPyTorch kernel and mean."""

from __future__ import annotations

import dataclasses

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.means import Mean, ZeroMean
from torch import Tensor

from gpsd._internal.fitted import FitDependencies, Fitted
from gpsd._internal.memory_check import check_dense_matrices_fit
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.validation import (
    check_gp_modules,
    check_int,
    check_positive_float,
    check_test_inputs,
)
from gpsd._internal.variance import nonnegative_variance
from gpsd.laplace.laplace_posterior import LaplacePosterior
from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms
from gpsd.laplace.newton import LaplaceMode
from gpsd.laplace.predictive import (
    binary_class_probabilities,
    closed_form_probability,
    expected_response,
)
from gpsd.laplace.prior import prior_at_test, prior_at_training
from gpsd.laplace.resolve import likelihood_module, resolve_likelihood_terms
from gpsd.laplace.training_data import ClassificationTrainingData, checked_classification_data
from gpsd.prediction import Prediction
from gpsd.progress import Callback

__all__ = ["LaplaceGPClassifier"]

#: N x N matrices a Laplace fit holds at its peak, per problem of the batch (4.1 measured at
#: N = 3000 and 4000 on the CPU: the peak resident memory over one float64 matrix)
_NEWTON_MATRICES = 4


@dataclasses.dataclass(frozen=True, eq=False)
class _LaplaceFit:
    """A :class:`LaplaceGPClassifier`'s fit.

    :param posterior: The :class:`~gpsd.laplace.LaplacePosterior` at the fitted hyperparameters,
        its prior without autograd history; its mode is ``posterior.mode``.
    """

    posterior: LaplacePosterior


class LaplaceGPClassifier(Fitted, ClassificationTrainingData, gpytorch.Module):
    r"""A GP classifier (or soft-target model) with the Laplace approximation of the posterior.

    Prior :math:`f \sim \mathcal{GP}(m, k)`, observations :math:`y_i \mid f_i \sim p(y \mid f_i)`
    (any log-concave 1-D likelihood, raised to the power :math:`\tau`), optional noise
    :math:`\gamma` on the kernel diagonal of the training inputs (Borup & Andersen, Fig. 5):

    .. math::

        q(\mathbf f \mid \mathbf y) = \mathcal{N}\bigl(\hat{\mathbf f},
        (\tilde{\mathbf K}^{-1} + \mathbf W)^{-1}\bigr), \qquad
        \tilde{\mathbf K} = \mathbf K + \gamma \mathbf I, \qquad
        \mathbf W = -\tau \nabla\nabla \log p(\mathbf y \mid \hat{\mathbf f}),

    and the predictive latent distribution (eqs. 2-3)

    .. math::

        \mu_* = m(\mathbf x_*) + \mathbf k_*^\top \tilde{\mathbf K}^{-1}(\hat{\mathbf f} - \mathbf m),
        \qquad \sigma_*^2 = k_{**} - \mathbf k_*^\top(\tilde{\mathbf K} + \mathbf W^{-1})^{-1}
        \mathbf k_*.

    The model composes a :class:`~gpsd.laplace.LaplacePosterior` (:meth:`posterior`): the mode is
    found by Newton's method in the stable B-form, warm started from the last mode. :meth:`log_marginal_likelihood` is differentiable in the kernel and
    mean hyperparameters (total derivative, including the dependence of the mode), so they train in
    an ordinary torch loop. The model fits lazily: :meth:`fit` need not be called, the first
    prediction fits, and predictions refit the mode when the fit is stale (:meth:`fit` lists
    when), so they always belong to the current hyperparameters.

    Predictions follow scikit-learn's classifiers: :meth:`predict_proba` gives both classes'
    probabilities ``(*batch, M, 2)``, :meth:`predict` the labels ``(*batch, M)``,
    :meth:`predict_latent` the latent :class:`~gpsd.Prediction`, and ``model(test_x)`` the latent
    ``MultivariateNormal``.

    With gradients enabled and a parameter that requires them (the default outside
    ``torch.no_grad()``), predictions are differentiable in the hyperparameters through the
    mode (:func:`~gpsd.laplace.differentiable_mode`), which costs one more evaluation of the
    training kernel and factorisation of :math:`\mathbf B` per call: 200 ms against 5.6 ms
    under ``torch.no_grad()`` at :math:`n = 2000`, 10 test points, one CPU thread. Evaluate
    under ``torch.no_grad()`` where no gradient is needed.

    Everything is computed in the training inputs' dtype. float32 holds float32 accuracy for
    moderate output scales; on separable data with a very large output scale the float32 mode
    sits where the posterior is flat and tiny curvatures :math:`\mathbf W` decide the
    variances: at outputscale :math:`10^8` (12 points) latent variances were 3 to 22 % off the
    float64 ones, at :math:`10^6` 0.2 %. Fit in float64 there.

    The training data are stored detached: targets that carry an autograd graph (a teacher's
    differentiable ``predict_proba``, say) are constants to this model.

    :param train_x: Training inputs, shape ``(n, d)`` or ``(n,)``, float32 or float64.
    :param train_y: Targets, shape ``(*batch, n)``: 0/1 labels for the Bernoulli likelihoods, soft
        targets in [0, 1] for the continuous Bernoulli.
    :param covar_module: Any GPyTorch kernel.
    :param likelihood: ``"bernoulli_logit"`` (default), ``"bernoulli_probit"``,
        ``"continuous_bernoulli"``, a GPyTorch likelihood (autograd derivatives unless it is the
        continuous Bernoulli or GPyTorch's probit ``BernoulliLikelihood``), or
        :class:`~gpsd.laplace.LaplaceLikelihoodTerms`.
    :param mean_module: Prior mean (default zero).
    :param noise: :math:`\gamma \ge 0` added to the kernel diagonal of the training inputs.
    :param temperature: :math:`\tau > 0` (``t`` duplicates of the data correspond to ``tau = t``).
    :param max_iter: Newton iteration limit.
    :raises TypeError: for ``train_x`` of another dtype than float32 or float64.

    Example:

        >>> model = LaplaceGPClassifier(x, y, ScaleKernel(RBFKernel()))
        >>> opt = torch.optim.Adam(model.parameters(), lr=0.05)
        >>> for _ in range(50):
        ...     opt.zero_grad(); (-model.log_marginal_likelihood()).backward(); opt.step()
        >>> probs = model.fit().predict_proba(test_x)  # shape: (M, 2)
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: Kernel,
        *,
        mean_module: Mean | None = None,
        likelihood: object = "bernoulli_logit",
        noise: float = 0.0,
        temperature: float = 1.0,
        max_iter: int = 100,
    ) -> None:
        super().__init__()
        check_gp_modules(covar_module, mean_module)
        self.terms: LaplaceLikelihoodTerms = resolve_likelihood_terms(likelihood)
        train_x, train_y = checked_classification_data(train_x, train_y, self.terms)
        module = likelihood_module(likelihood, self.terms)
        if module is not None:
            self.likelihood = module  # its parameters train with the kernel's; a change refits
        noise = check_positive_float(noise, "noise", allow_zero=True)
        temperature = check_positive_float(temperature, "temperature")
        max_iter = check_int(max_iter, "max_iter")
        self.covar_module = covar_module
        self.mean_module = mean_module if mean_module is not None else ZeroMean()
        self.temperature = float(temperature)
        self.max_iter = max_iter
        self.register_buffer("train_inputs", train_x)
        self.register_buffer("train_targets", train_y)
        self.register_buffer(
            "noise", torch.tensor(noise, dtype=train_x.dtype, device=train_x.device)
        )
        self.register_buffer("latent_mode", torch.zeros_like(train_y))
        self.register_buffer("mode_available", torch.tensor(False, device=train_x.device))
        #: the losses of the last :meth:`optimize_hyperparameters`, one per iteration
        self.history: list[float] = []

    # ----------------------------------------------------------------------------------------
    _resizable_buffers = ("latent_mode", "train_inputs", "train_targets")

    def prior_train(self) -> tuple[Tensor, Tensor]:
        r"""Prior mean ``(*batch, n)`` and covariance :math:`\mathbf K + \gamma\mathbf I`
        ``(*batch, n, n)`` of the training latents (with autograd history)."""
        return prior_at_training(
            self.covar_module, self.mean_module, self.train_inputs, self.train_targets, self.noise
        )

    def _fit_dependencies(self) -> FitDependencies:
        return FitDependencies(
            (self.covar_module, self.mean_module, getattr(self, "likelihood", None)),
            (self.train_inputs, self.train_targets, self.noise),
            (self.temperature, self.max_iter),
        )

    @property
    def mode(self) -> LaplaceMode:
        """The :class:`~gpsd.laplace.LaplaceMode` at the current hyperparameters (fitted on first
        use, refitted when the fit is stale: see :meth:`fit`)."""
        return self._fitted_posterior().mode

    def _fitted_posterior(self) -> LaplacePosterior:
        """The :class:`~gpsd.laplace.LaplacePosterior` of the last fit (its prior without autograd
        history), refitted where the fit is stale."""
        return self._current_fit().posterior

    def _compute_fit(self, init_f: Tensor | None = None, warm_start: bool = True) -> _LaplaceFit:
        """Newton at the current hyperparameters; the mode is written to :attr:`latent_mode`."""
        check_dense_matrices_fit(
            f"{type(self).__name__}.fit",
            _NEWTON_MATRICES,
            self.train_inputs,
            torch.broadcast_shapes(self.train_targets.shape[:-1], self.covar_module.batch_shape),
            "the kernel matrix, B = I + W^1/2 K W^1/2, its Cholesky factor and a temporary",
            "train on fewer points, or in float32 for half the bytes",
        )
        with torch.no_grad():
            m, K = self.prior_train()
            shape = torch.broadcast_shapes(K.shape[:-1], m.shape, self.train_targets.shape)
            # the last mode serves as a start only for data of the same shape (new data may
            # have another n or batch shape)
            if (
                init_f is None
                and warm_start
                and bool(self.mode_available)
                and self.latent_mode.shape == shape
            ):
                init_f = self.latent_mode
            posterior = LaplacePosterior(
                m,
                K,
                self.terms,
                self.train_targets,
                init_f=init_f,
                temperature=self.temperature,
                max_iter=self.max_iter,
            )
            f = posterior.mode.f
            if self.latent_mode.shape != f.shape:
                self.latent_mode = f.clone()
            else:
                self.latent_mode.copy_(f)
            self.mode_available.fill_(True)
        return _LaplaceFit(posterior)

    def fit(self, *, init_f: Tensor | None = None, warm_start: bool = True) -> LaplaceGPClassifier:
        """Find the Laplace mode at the current hyperparameters now (warm start from the last
        mode); returns ``self``.

        The model also fits lazily, on first use, and refits when the fit is stale: when a
        parameter or buffer of ``covar_module``, ``mean_module`` or the likelihood, the training
        data or ``noise`` has another value, shape, dtype or device (an optimiser step, a write
        through ``.data``, ``load_state_dict``, ``.to()``), when a setting of the model
        (``temperature``, ``max_iter``) or a :mod:`gpsd.settings` value that can change a result
        has changed, and after a backward pass through the fit's graph (the mode is found
        without autograd, so a gradient needed later does not refit). Nothing else refits:
        a fit made under grad mode serves predictions under ``torch.no_grad()`` as it is, and
        copies and pickles of the model refit on first use. A loaded :attr:`latent_mode` is
        the warm start of the next fit. Call ``fit()`` to choose the starting point.

        :param init_f: An explicit starting point ``(*batch, n)`` (e.g. another model's mode).
        :param warm_start: Start from the last mode if there is one.
        :return: ``self``.
        """
        self._refit(init_f=init_f, warm_start=warm_start)
        return self

    def posterior(self) -> LaplacePosterior:
        """The :class:`~gpsd.laplace.LaplacePosterior` at the current hyperparameters (fitted
        where needed, as :attr:`mode`); its prior carries autograd history where gradients are
        enabled and a parameter requires them, so that its evidence and predictions are
        differentiable in the hyperparameters (the mode's own dependence on them included)."""
        fitted = self._fitted_posterior()
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())):
            return fitted
        m, K = self.prior_train()
        return LaplacePosterior(
            m,
            K,
            self.terms,
            self.train_targets,
            mode=fitted.mode,
            temperature=self.temperature,
        )

    def log_marginal_likelihood(self) -> Tensor:
        r"""The Laplace approximation of :math:`\log p(\mathbf y)`, shape ``batch``,
        differentiable in the hyperparameters (see
        :meth:`~gpsd.laplace.LaplacePosterior.log_marginal_likelihood`).

        The evidence alone: hyperpriors registered on the modules are not included (see
        :meth:`log_prior`; :meth:`optimize_hyperparameters` adds them)."""
        return self.posterior().log_marginal_likelihood()

    def _test_inputs(self, x: Tensor) -> Tensor:
        return check_test_inputs(x, self.train_inputs)

    def forward(self, x: Tensor) -> MultivariateNormal:
        """The latent predictive distribution at ``x`` (full covariance), ``(*batch, M)``."""
        x = self._test_inputs(x)
        posterior = self.posterior()
        K_cross, K_test, prior_mean = prior_at_test(
            self.covar_module, self.mean_module, x, self.train_inputs, diag=False
        )
        mean, cov = posterior.predictive(K_cross, K_test, prior_mean, diag=False)
        jitter = 1e-10 if cov.dtype == torch.float64 else 1e-6
        cov = cov + jitter * torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        return MultivariateNormal(mean, cov)

    def predict_latent(self, test_x: Tensor) -> Prediction:
        """The latent predictive mean and variance at ``test_x``, each ``(*batch, M)``;
        differentiable in the hyperparameters (the mode's own dependence on them included)."""
        x = self._test_inputs(test_x)
        posterior = self.posterior()
        K_cross, K_diag, prior_mean = prior_at_test(
            self.covar_module, self.mean_module, x, self.train_inputs, diag=True
        )
        mean, var = posterior.predictive(K_cross, K_diag, prior_mean, diag=True)
        return Prediction(mean, nonnegative_variance(var, K_diag))

    def _positive_probability(self, test_x: Tensor, method: str, num_points: int) -> Tensor:
        r""":math:`\mathbb{E}_q[r(f_*)]`, ``(*batch, M)``."""
        latent = self.predict_latent(test_x)
        if method == "quadrature":
            return expected_response(self.terms, latent.mean, latent.variance, num_points)
        if method == "probit":
            return closed_form_probability(self.terms, latent.mean, latent.variance)
        raise ValueError(f"method must be 'quadrature' or 'probit', got {method!r}")

    def predict_proba(
        self, test_x: Tensor, *, method: str = "quadrature", num_points: int = 64
    ) -> Tensor:
        r"""The class probabilities at ``test_x``, shape ``(*batch, M, 2)``: column 1 is
        :math:`\mathbb{E}_q[r(f_*)]` with :math:`r` the likelihood's response (:math:`\sigma`
        for logistic and continuous Bernoulli, :math:`\Phi` for probit), column 0 its
        complement (scikit-learn's layout). For the continuous Bernoulli, column 1 is the
        predicted soft target.

        :param test_x: Test inputs, shape ``(M, d)`` or ``(M,)`` (as the training inputs).
        :param method: ``"quadrature"`` (:func:`~gpsd.laplace.expected_response` with
            ``num_points`` nodes: accurate at any latent variance for the built-in likelihoods)
            or ``"probit"`` (closed form: exact :math:`\Phi(\mu/\sqrt{1 + s^2})` for a probit
            response, MacKay's approximation :math:`\sigma(\mu/\sqrt{1 + \pi s^2/8})`
            otherwise).
        :param num_points: Quadrature nodes of ``"quadrature"`` (default 64).
        """
        return binary_class_probabilities(self._positive_probability(test_x, method, num_points))

    def predict(self, test_x: Tensor) -> Tensor:
        """The predicted labels at ``test_x``, ``(*batch, M)``, a ``torch.long`` tensor: 1 where
        the positive class is more probable than not (:meth:`predict_proba`'s column 1 above
        1/2), else 0. Computed without autograd."""
        with torch.no_grad():
            return (self._positive_probability(test_x, "quadrature", 64) > 0.5).long()

    def log_prior(self) -> Tensor:
        r""":math:`\sum_j \log p_j(\theta_j)` over the hyperpriors registered on the kernel, the
        mean and the likelihood, a scalar (0 without priors): as in GPyTorch's marginal
        likelihoods, ``prior.log_prob(closure(module))`` summed over ``named_priors()``."""
        total = self.train_inputs.new_zeros(())
        for _, module, prior, closure, _ in self.named_priors():
            total = total + prior.log_prob(closure(module)).sum()
        return total

    def optimize_hyperparameters(
        self,
        *,
        max_iter: int = 50,
        lr: float = 0.05,
        progress: object = False,
        callback: Callback | None = None,
    ) -> LaplaceGPClassifier:
        r"""Maximise the log posterior of the hyperparameters with Adam (at most ``max_iter``
        iterations, learning rate ``lr``), then refit; returns ``self``, with the loss of every
        iteration in :attr:`history`.

        The loss is

        .. math::

            -\sum_b \log q(\mathbf y_b \mid \theta) - \sum_j \log p_j(\theta_j),

        the negated :meth:`log_marginal_likelihood` summed over the batch and :meth:`log_prior`,
        the hyperpriors registered on the modules (as GPyTorch's marginal likelihoods add them);
        without priors, the evidence alone.

        :param max_iter: The most Adam iterations.
        :param lr: Adam's learning rate.
        :param progress: ``True`` for a ``tqdm`` bar, or a bar of your own (:mod:`gpsd.progress`).
        :param callback: Called after each iteration with an :class:`~gpsd.IterationRecord`
            (``loss`` the loss before the iteration's step); returning ``True`` stops.
        """
        check_progress(progress, callback)
        max_iter = check_int(max_iter, "max_iter", minimum=0)
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable hyperparameters")
        optimizer = torch.optim.Adam(params, lr=lr)
        self.history = []
        task = f"{type(self).__name__}.optimize_hyperparameters"
        with ProgressReporter(task, max_iter, progress, callback) as report:
            for iteration in range(1, max_iter + 1):
                optimizer.zero_grad()
                loss = -(self.log_marginal_likelihood().sum() + self.log_prior())
                loss.backward()
                optimizer.step()
                self.history.append(loss.item())
                if report.update(iteration, loss=self.history[-1]):
                    break
        return self.fit()
