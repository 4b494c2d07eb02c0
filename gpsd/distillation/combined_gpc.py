r"""The combined self-distillation chain of GP classification: continuous-Bernoulli data-centric
steps inside distribution-centric ones (Borup & Andersen, "Combined and extended directions")."""

from __future__ import annotations

import dataclasses

import gpytorch
import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean, ZeroMean
from torch import Tensor

from gpsd._internal.fitted import FitDependencies, Fitted
from gpsd._internal.memory_check import check_dense_matrices_fit
from gpsd._internal.module_state import check_saved_num_steps, choice_setting
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.validation import check_gp_modules, check_int
from gpsd._internal.variance import nonnegative_variance
from gpsd.distillation._gpc_steps import StepwiseClassifier
from gpsd.distillation._step_distiller import NoiseRule
from gpsd.distillation._step_grid import StepGrid, noise_grid_schedule
from gpsd.laplace import (
    BernoulliLogitTerms,
    ClassificationTrainingData,
    ContinuousBernoulliTerms,
    LaplaceLikelihoodTerms,
    LaplacePosterior,
    checked_classification_data,
    constant_parameters,
    prior_at_test,
    prior_at_training,
    probit_approximation,
    symmetric_response_expectation,
)
from gpsd.progress import Callback

__all__ = ["CombinedGPC"]

_METHODS = ("iterated", "tempered")
#: N x N matrices a fit holds at its peak, per problem of the batch: these plus two per step.
#: The peak resident memory of a fit over one float64 matrix, at N = 1500 on the CPU, is 17.1,
#: 19.1 and 27.1 for ``"iterated"`` at T = 1, 4 and 8 (O x I = 1 x 1, 2 x 2, 2 x 4), and 15.1,
#: 16.1 and 23.3 for ``"tempered"``: the kernel matrix and its computation, the recursion's
#: prior and products, Newton's factorisation, and the correction each step keeps
_WORKING_MATRICES = {"iterated": 16, "tempered": 14}
_MATRICES_PER_STEP = 2


class _WeightedBernoulliTerms(LaplaceLikelihoodTerms):
    r"""The Bernoulli-logistic and continuous Bernoulli log-likelihoods mixed with weights
    :math:`1 - w` and :math:`w` on one soft target :math:`y \in [0, 1]`,

    .. math::

        \ell_w(y, f) = y f - (1 - w)\log(1 + e^f) - w A(f),

    :math:`A` the continuous Bernoulli's log normaliser: the likelihood of the tempered chain,
    whose terms are linear in their targets."""

    name = "weighted Bernoulli and continuous Bernoulli"
    symmetric_response = True

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self._bernoulli = BernoulliLogitTerms()
        self._continuous = ContinuousBernoulliTerms()

    def log_prob(self, y: Tensor, f: Tensor) -> Tensor:
        w = self.weight
        return (1.0 - w) * self._bernoulli.log_prob(y, f) + w * self._continuous.log_prob(y, f)

    def derivatives(self, y: Tensor, f: Tensor) -> tuple[Tensor, Tensor]:
        w = self.weight
        g_b, h_b = self._bernoulli.derivatives(y, f)
        g_c, h_c = self._continuous.derivatives(y, f)
        return (1.0 - w) * g_b + w * g_c, (1.0 - w) * h_b + w * h_c

    def response(self, f: Tensor) -> Tensor:
        return torch.sigmoid(f)

    def check_targets(self, y: Tensor, name: str = "train_y") -> None:
        self._continuous.check_targets(y, name)


def _chain_terms(soft_weight: float) -> LaplaceLikelihoodTerms:
    """The terms whose continuous Bernoulli share is ``soft_weight``: the plain Bernoulli-logistic
    or continuous Bernoulli terms at the ends, the mixture between them."""
    if soft_weight == 0.0:
        return BernoulliLogitTerms()
    if soft_weight == 1.0:
        return ContinuousBernoulliTerms()
    return _WeightedBernoulliTerms(soft_weight)


@dataclasses.dataclass(frozen=True)
class _CombinedFit:
    """The fitted steps of a :class:`CombinedGPC`, entry ``t - 1`` for flat step ``t``: the
    posterior ``(c, Q)``, the targets ``(*batch, n)`` and the Laplace mode ``(*batch, n)``."""

    posteriors: tuple[tuple[Tensor, Tensor], ...]
    targets: tuple[Tensor, ...]
    modes: tuple[Tensor, ...]


class CombinedGPC(
    Fitted, StepGrid, StepwiseClassifier, ClassificationTrainingData, gpytorch.Module
):
    r"""The combined self-distillation chain of a Laplace GP classifier.

    An outer distribution-centric loop of :math:`O` steps, whose prior is the previous outer
    step's Laplace posterior (as in :class:`~gpsd.DistributionCentricGPC`), around an inner
    data-centric loop of :math:`I` continuous-Bernoulli steps with that prior held fixed (as in
    :class:`~gpsd.DataCentricGPC`). Starting from :math:`\mathcal{GP}(m_0, k_0) =
    \mathcal{GP}(m, k)`, inner step :math:`i` of outer step :math:`o` fits a Laplace GPC with the
    prior :math:`\mathcal{GP}(m_{o-1}, k_{o-1})`, the noise :math:`\gamma_{o,i} \ge 0` on the
    kernel diagonal of the training inputs, to the targets :math:`\mathbf y_{o,i-1}`:

    .. math::

        \mathbf y_{o,0} = \mathbf y \in \{0, 1\}^N, \qquad
        \mathbf y_{o,i} = \mathbb{E}_{q_{o,i}}[\sigma(\mathbf f)] \in [0, 1]^N,

    with the Bernoulli-logistic likelihood at :math:`i = 1` and the continuous Bernoulli

    .. math::

        \log p(\mathbf y_{o,i-1} \mid \mathbf f) = \mathbf y_{o,i-1}^\top \mathbf f
        - \sum_n A(f_n), \qquad A(f) = \log(1 + e^f) - \log C(\sigma(f)),

    at :math:`i \ge 2`. The posterior :math:`q_{o,I}` of the last inner step,
    :math:`\mathcal{GP}(m_o, k_o)`, is the prior of outer step :math:`o + 1`; every inner loop
    starts again from the labels :math:`\mathbf y`. ``outer_steps=1`` is
    :class:`~gpsd.DataCentricGPC`; ``inner_steps=1`` is :class:`~gpsd.DistributionCentricGPC`
    with the same ``method``.

    **Steps.** The :math:`T = O \cdot I` steps run along one step dimension, outer step by outer
    step, as in :class:`~gpsd.CombinedGPR`: step :math:`(o, i)` has the flat index
    :math:`t = (o - 1)\,I + i`, counted from 1; :meth:`flat_step` and :meth:`grid_step` convert.
    ``predict_proba(test_x)`` has shape ``(*batch, T, M, 2)``, row ``t - 1`` for step ``t``;
    ``step=t`` and :meth:`best_step` take and give a flat ``t``.

    **The iterated chain** (``method="iterated"``). Every posterior is kept in the form

    .. math::

        m_{o,i}(x) = m(x) + k(x, \mathbf X)\,\mathbf c_{o,i}, \qquad
        k_{o,i}(x, x') = k(x, x') - k(x, \mathbf X)\,\mathbf Q_{o,i}\,k(\mathbf X, x'),

    with :math:`\mathbf c_{0} = \mathbf 0`, :math:`\mathbf Q_{0} = \mathbf 0` for the prior
    :math:`\mathcal{GP}(m, k)` and :math:`(\mathbf c_{o-1}, \mathbf Q_{o-1}) =
    (\mathbf c_{o-1,I}, \mathbf Q_{o-1,I})` for the prior of outer step :math:`o`. With
    :math:`\mathbf P = \mathbf I - \mathbf Q_{o-1}\mathbf K`, so that :math:`k_{o-1}(x,
    \mathbf X) = k(x, \mathbf X)\,\mathbf P`, step :math:`(o, i)` finds the Laplace mode
    :math:`\hat{\mathbf f}_{o,i}` under :math:`\mathcal N(m_{o-1}(\mathbf X),
    \tilde{\mathbf K}_{o,i})`, :math:`\tilde{\mathbf K}_{o,i} = \mathbf K\mathbf P +
    \gamma_{o,i}\mathbf I`, with its :math:`\hat{\mathbf a} = \tilde{\mathbf K}_{o,i}^{-1}
    (\hat{\mathbf f}_{o,i} - m_{o-1}(\mathbf X))` and :math:`\mathbf W`; the Laplace posterior
    of the latent function (R&W eqs. 3.21, 3.24 under the prior :math:`\mathcal{GP}(m_{o-1},
    k_{o-1})`) is then

    .. math::

        \mathbf c_{o,i} = \mathbf c_{o-1} + \mathbf P\,\hat{\mathbf a}, \qquad
        \mathbf Q_{o,i} = \mathbf Q_{o-1} + \mathbf P\,(\tilde{\mathbf K}_{o,i}
        + \mathbf W^{-1})^{-1}\,\mathbf P^\top,

    and the next targets are :math:`\mathbf y_{o,i} = \mathbb{E}[\sigma(f_n)]`,
    :math:`f_n \sim \mathcal N(m(x_n) + \mathbf K_n\mathbf c_{o,i}, k(x_n, x_n) -
    \mathbf K_n\mathbf Q_{o,i}\mathbf K_n^\top)`. Predictions of any step cost :math:`O(N^2)`
    per test point.

    **The tempered chain** (``method="tempered"``). For a Gaussian likelihood, conditioning the
    posterior of earlier steps on new targets is conditioning the prior :math:`\mathcal{GP}(m,
    k)` on all of them at once; :class:`~gpsd.DistributionCentricGPC`'s ``"tempered"`` method
    makes one Laplace fit of that product of likelihoods instead of a chain of fits. Here step
    :math:`(o, i)` conditions on the likelihoods of the last inner steps of the earlier outer
    steps and on its own,

    .. math::

        \ell_{o,i}(\mathbf f) = \sum_{p < o} \log p_I(\mathbf y_{p,I-1} \mid \mathbf f)
        + \log p_i(\mathbf y_{o,i-1} \mid \mathbf f),

    in one Laplace fit under :math:`\mathcal{GP}(m, k)`. The Bernoulli-logistic and continuous
    Bernoulli log-likelihoods are both linear in their targets, so :math:`\ell_{o,i}` is
    :math:`o` times the likelihood :math:`y f - (1 - w)\log(1 + e^f) - w A(f)` of the mean
    target :math:`\bar{\mathbf y}_{o,i} = \frac1o(\sum_{p < o}\mathbf y_{p,I-1} +
    \mathbf y_{o,i-1})`, with :math:`w` the share of continuous Bernoulli terms among the
    :math:`o`: a Laplace fit at temperature :math:`o`. With :math:`I = 1` this is the labels'
    likelihood raised to the power :math:`o`, the tempered posterior of
    :class:`~gpsd.DistributionCentricGPC`; its posterior keeps :math:`\mathbf c_{o,i} =
    \hat{\mathbf a}`, :math:`\mathbf Q_{o,i} = (\mathbf K + \mathbf W^{-1})^{-1}`. Every step
    is one Newton solve under the same prior. A noise :math:`\gamma_{o,i}` would give every
    step's likelihood latent values of its own, which one fit cannot hold: ``"tempered"`` takes
    noise 0 alone.

    The model fits lazily, as :class:`~gpsd.DataCentricGPC`: :meth:`fit` need not be called,
    and predictions refit when a parameter or buffer (``noise`` among them), a setting
    (``method``, ``target_method``, ``max_iter``) or a :mod:`gpsd.settings` value has changed
    since the last fit. Each step warm-starts Newton's method from the previous step's mode.
    Predictions are differentiable in the test inputs; the hyperparameters are constants to
    them. The training data are stored detached; every step is computed in the training
    inputs' dtype. A fit keeps one :math:`N \times N` matrix per step.

    :param train_x: Training inputs ``(n, d)`` or ``(n,)``, float32 or float64.
    :param train_y: Binary labels ``(*batch, n)`` in {0, 1}.
    :param covar_module: The kernel :math:`k`.
    :param noise: :math:`\gamma_{o,i} \ge 0`: one value (every step; then ``outer_steps`` and
        ``inner_steps`` are needed), or a grid of shape ``(*s, O, I)``, row ``o - 1``, column
        ``i - 1`` for step :math:`(o, i)` (a batch of grids ``*s`` broadcasts with the batch of
        the labels). :attr:`noise` holds it flat, ``(*s, T)``; assigning ``model.noise`` takes one
        value or such a flat schedule.
    :param inner_steps: :math:`I \ge 1`, the data-centric steps per outer step (default: from the
        grid ``noise``).
    :param outer_steps: :math:`O \ge 1`, the distribution-centric steps (default: from the grid
        ``noise``).
    :param mean_module: Prior mean (default zero).
    :param method: ``"iterated"`` (the chain of Laplace fits) or ``"tempered"`` (one fit of the
        chain's likelihoods per step), as in :class:`~gpsd.DistributionCentricGPC`.
    :param target_method: ``"quadrature"`` (:func:`~gpsd.laplace.symmetric_response_expectation`)
        or ``"probit"`` (MacKay's approximation) for :math:`\mathbb{E}_q[\sigma(f)]`.
    :param max_iter: Newton iterations allowed per Laplace fit.

    Example:

        >>> model = CombinedGPC(x, y, covar_module, outer_steps=3, inner_steps=2).fit()
        >>> model.predict_proba(test_x).shape  # (6, M, 2): steps (1,1), (1,2), ..., (3,2)
        >>> model.grid_step(model.best_step(val_x=val_x, val_y=val_y))  # (outer, inner)
        >>> model.predict(test_x, step=model.flat_step(2, 1))
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: Kernel,
        *,
        noise: object = 0.0,
        inner_steps: int | None = None,
        outer_steps: int | None = None,
        mean_module: Mean | None = None,
        method: str = "iterated",
        target_method: str = "quadrature",
        max_iter: int = 100,
    ) -> None:
        super().__init__()
        check_gp_modules(covar_module, mean_module)
        self.method = method
        self.target_method = target_method
        self.max_iter = check_int(max_iter, "max_iter")
        train_x, train_y = checked_classification_data(train_x, train_y, self._target_terms)
        noise, self._outer_steps, self._inner_steps = noise_grid_schedule(
            noise, train_x, outer_steps, inner_steps
        )
        self.covar_module = covar_module
        self.mean_module = mean_module if mean_module is not None else ZeroMean()
        self.register_buffer("train_inputs", train_x)
        self.register_buffer("train_targets", train_y)
        self._init_steps(None, noise, train_x)
        self._check_noise_batch()
        # per step, (T, *batch, n): step_targets() and latent_modes() lay them out
        shape = (self.num_steps, *train_y.shape)
        self.register_buffer("_step_targets", train_x.new_zeros(shape))
        self.register_buffer("_latent_modes", train_x.new_zeros(shape))
        #: Newton iterations of each step of the last fit, entry ``t - 1`` for flat step ``t``
        self.newton_iterations: list[int] = []

    @property
    def _target_terms(self) -> BernoulliLogitTerms:
        """The training targets are 0/1 labels (the Bernoulli likelihood of inner step 1)."""
        return BernoulliLogitTerms()

    _noise_rule = NoiseRule(positive=False)

    #: :math:`\gamma_{o,i}`, a buffer of shape ``(*s, T)`` (entry ``t - 1`` for flat step ``t``;
    #: :attr:`noise_grid` shows it as ``(*s, O, I)``) in the training inputs' dtype. Assigning
    #: one number or flat schedules of ``T`` numbers (checked) or writing into it refits on use.
    noise: Tensor

    method = choice_setting(
        "method", _METHODS, '``"iterated"`` or ``"tempered"``; a new one refits on use.'
    )
    target_method = choice_setting(
        "target_method",
        ("quadrature", "probit"),
        "How the soft targets :math:`\\mathbb{E}_q[\\sigma(f)]` are computed; a new one refits on use.",
    )

    def _check_noise_batch(self) -> None:
        """A ``ValueError`` unless the batch of the schedules broadcasts with the labels' and the
        kernel's, and the noise is 0 for ``"tempered"``."""
        self._schedule_batch()
        if self.method == "tempered" and bool((self.noise != 0).any()):
            raise ValueError(
                "method='tempered' takes noise 0 at every step (one Laplace fit of the chain's "
                f"likelihoods has no latent values per step to add noise to), got noise "
                f"{self.noise.tolist()}; pass noise=0.0 or method='iterated'"
            )

    _resizable_buffers = ("_step_targets", "_latent_modes", "train_inputs", "train_targets")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_saved_num_steps(self, state_dict.get(prefix + "_step_targets"))
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _fit_dependencies(self) -> FitDependencies:
        return FitDependencies(
            (self.covar_module, self.mean_module),
            (self.train_inputs, self.train_targets, self.noise),
            (self.method, self.target_method, self.max_iter),
        )

    def _compute_fit(
        self, progress: object = False, callback: Callback | None = None
    ) -> _CombinedFit:
        posteriors = self._run(progress, callback)
        fitted = range(len(posteriors))
        return _CombinedFit(
            tuple(posteriors),
            tuple(self._step_targets[t].clone() for t in fitted),
            tuple(self._latent_modes[t].clone() for t in fitted),
        )

    def _soft_targets(self, m: Tensor, K: Tensor, c: Tensor, Q: Tensor) -> Tensor:
        r""":math:`\mathbb{E}[\sigma(f_n)]` at the training inputs under the posterior
        :math:`(\mathbf c, \mathbf Q)`, ``(*batch, n)``."""
        mean = m + (K @ c.unsqueeze(-1)).squeeze(-1)
        prior_var = torch.diagonal(K, dim1=-2, dim2=-1)
        var = nonnegative_variance(prior_var - ((K @ Q) * K).sum(-1), prior_var)
        if self.target_method == "probit":
            return probit_approximation(mean, var)
        return symmetric_response_expectation(torch.sigmoid, mean, var)

    def _record(self, step: int, targets: Tensor, mode_f: Tensor) -> None:
        """Keep step ``step``'s targets and mode in the buffers (resized to the batch)."""
        if self._step_targets[step - 1].shape != targets.shape:
            self._step_targets = targets.new_zeros(self.num_steps, *targets.shape)
            self._latent_modes = torch.zeros_like(self._step_targets)
        self._step_targets[step - 1] = targets
        self._latent_modes[step - 1] = mode_f

    def _run(
        self, progress: object = False, callback: Callback | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """Fit the steps in flat order (fewer where ``callback`` stops); returns the posterior
        ``(c, Q)`` of each."""
        self._check_noise_batch()  # labels of another batch (set_train_data), or a new method
        batch = self._schedule_batch()
        check_dense_matrices_fit(
            f"{type(self).__name__}.fit",
            _WORKING_MATRICES[self.method] + _MATRICES_PER_STEP * self.num_steps,
            self.train_inputs,
            batch,
            "the kernel matrix, the chain's working matrices and the posterior each step keeps",
            "fit fewer steps, train on fewer points, or in float32 for half the bytes",
        )
        iterated = self.method == "iterated"
        O, I = self.outer_steps, self.inner_steps
        with torch.no_grad():
            m, K = prior_at_training(
                self.covar_module, self.mean_module, self.train_inputs, self.train_targets
            )
            n = K.shape[-1]
            m, K = m.expand(*batch, n), K.expand(*batch, n, n)
            labels = self.train_targets.expand(*batch, n)
            eye = torch.eye(n, dtype=K.dtype, device=K.device)
            # the prior of the outer step, (c, Q) (iterated); the sum of the targets of the
            # earlier outer steps' last inner steps and how many of them are soft (tempered)
            c_prior, Q_prior = torch.zeros_like(m), torch.zeros_like(K)
            earlier_targets, earlier_soft = torch.zeros_like(m), 0
            steps: list[tuple[Tensor, Tensor]] = []
            self.newton_iterations = []
            init = None
            task = f"{type(self).__name__}.fit"
            for o in range(1, O + 1):
                if iterated:
                    P = eye - Q_prior @ K  # k_{o-1}(x, X) = k(x, X) P
                    K_prior = K @ P
                    K_prior = 0.5 * (K_prior + K_prior.transpose(-1, -2))
                    m_prior = m + (K @ c_prior.unsqueeze(-1)).squeeze(-1)
                targets = labels
                phase = f"outer step {o}"
                with ProgressReporter(task, I, progress, callback, phase=phase) as report:
                    for i in range(1, I + 1):
                        t = (o - 1) * I + i
                        if iterated:
                            noise = self.noise[..., t - 1]  # shape: (*s,)
                            K_step = K_prior
                            if not bool((noise == 0).all()):
                                K_step = K_prior + noise[..., None, None] * eye
                            posterior = LaplacePosterior(
                                m_prior,
                                K_step,
                                ContinuousBernoulliTerms() if i > 1 else BernoulliLogitTerms(),
                                targets,
                                init_f=init,
                                max_iter=self.max_iter,
                                check_targets=False,  # labels checked, or probabilities
                            )
                            mode = posterior.mode
                            S = posterior.covariance_correction()
                            c = c_prior + (P @ mode.alpha.unsqueeze(-1)).squeeze(-1)
                            Q = Q_prior + P @ S @ P.transpose(-1, -2)
                            Q = 0.5 * (Q + Q.transpose(-1, -2))
                        else:
                            soft = earlier_soft + (1 if i > 1 else 0)
                            posterior = LaplacePosterior(
                                m,
                                K,
                                _chain_terms(soft / o),
                                (earlier_targets + targets) / o,
                                init_f=init,
                                temperature=float(o),
                                max_iter=self.max_iter,
                                check_targets=False,
                            )
                            mode = posterior.mode
                            c, Q = mode.alpha, posterior.covariance_correction()
                        del posterior
                        steps.append((c, Q))
                        self.newton_iterations.append(mode.iterations)
                        self._record(t, targets, mode.f)
                        init = mode.f
                        if i == I:  # the prior, or the likelihoods, of the next outer step
                            c_prior, Q_prior = c, Q
                            earlier_targets = earlier_targets + targets
                            earlier_soft += 1 if I > 1 else 0
                        targets = self._soft_targets(m, K, c, Q)
                        loss = -float(mode.log_marginal_likelihood.sum())
                        info = {"newton_iterations": mode.iterations, "step": t}
                        if report.update(i, loss=loss, **info):
                            return steps
        return steps

    def fit(self, *, progress: object = False, callback: Callback | None = None) -> CombinedGPC:
        """Fit the ``T`` steps at the current hyperparameters; returns ``self``.

        Predictions call it themselves where needed (lazily). Each outer step is a phase
        ``"outer step o"`` for ``progress`` and ``callback``, each of its inner steps one
        iteration there (the record's ``loss`` is the step's negative Laplace log marginal
        likelihood, summed over the batch; its ``info`` holds the flat ``step``). A callback
        that returns ``True`` after flat step ``t`` leaves steps ``1..t`` fitted, and predictions
        then hold those steps alone until the next fit.

        :param progress: ``True`` for a ``tqdm`` bar per outer step, or a bar of your own
            (:mod:`gpsd.progress`).
        :param callback: Called after each step with an :class:`~gpsd.IterationRecord`.
        """
        check_progress(progress, callback)
        self._refit(progress=progress, callback=callback)
        return self

    def _fitted_steps(self) -> int:
        return len(self._current_fit().posteriors)

    def step_targets(self, step: int | None = None) -> Tensor:
        r"""The targets :math:`\mathbf y_{o,i-1}` each fitted step is fitted to (fitted first
        where needed): ``(*batch, T, n)``, row ``t - 1`` for flat step ``t`` (the labels at the
        first inner step of every outer step), or ``(*batch, n)`` for ``step=t``. After a fit
        that a callback stopped at step ``t``, the ``t`` fitted steps.

        :param step: a flat step ``t`` in ``1..T`` (default: every fitted step).
        """
        targets = self._current_fit().targets
        return self._rows_of_steps([targets[t - 1] for t in self._steps(step)], step)

    def latent_modes(self, step: int | None = None) -> Tensor:
        r"""The Laplace modes :math:`\hat{\mathbf f}_{o,i}` of the fitted steps at the training
        inputs (fitted first where needed), laid out as :meth:`step_targets`:
        ``(*batch, T, n)``, or ``(*batch, n)`` for ``step=t``. For ``"tempered"``, the mode of the
        step's one fit under :math:`\mathcal{GP}(m, k)`.

        :param step: a flat step ``t`` in ``1..T`` (default: every fitted step).
        """
        modes = self._current_fit().modes
        return self._rows_of_steps([modes[t - 1] for t in self._steps(step)], step)

    def _latent_at_step(self, x: Tensor, step: int) -> tuple[Tensor, Tensor]:
        c, Q = self._current_fit().posteriors[step - 1]
        with constant_parameters(self):
            K_cross, K_diag, prior_mean = prior_at_test(
                self.covar_module, self.mean_module, x, self.train_inputs, diag=True
            )
        mean = prior_mean + (K_cross @ c.unsqueeze(-1)).squeeze(-1)  # shape: (*batch, m)
        var = K_diag - ((K_cross @ Q) * K_cross).sum(-1)
        return mean, nonnegative_variance(var, K_diag)

    def _positive_probability(self, mean: Tensor, variance: Tensor, method: str) -> Tensor:
        if method == "probit":
            return probit_approximation(mean, variance)
        return symmetric_response_expectation(torch.sigmoid, mean, variance)
