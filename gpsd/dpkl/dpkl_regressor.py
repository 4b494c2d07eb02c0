"""DPKL: GP regression on probabilistic embeddings (Mallick et al., 2021)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from numbers import Real
from typing import Literal

import gpytorch
import torch
from torch import Tensor, nn

from gpsd._internal.negligible import drop_negligible
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.validation import check_int, check_positive_float
from gpsd.dpkl._regressor_base import EmbeddingGPRegressorBase, check_inputs, check_targets
from gpsd.dpkl.ard_gp_regressor import ARDGPRegressor
from gpsd.dpkl.embedding_kernel import ProbabilisticEmbeddingKernel
from gpsd.dpkl.expected_embedding_kernel import ExpectedEmbeddingKernel
from gpsd.dpkl.input_embedding_kernel import InputPlusEmbeddingKernel
from gpsd.dpkl.particle_ensemble import ParticleEnsemble
from gpsd.dpkl.random_feature_kernel import RandomFeatureKernel
from gpsd.progress import Callback

__all__ = ["DPKLRegressor"]

#: Below this many training rows :meth:`DPKLRegressor.fit` holds none out for validation.
_MIN_ROWS_TO_SPLIT = 10


def ard_kernel(train_x: Tensor) -> gpytorch.kernels.ScaleKernel:
    r"""``ScaleKernel(RBFKernel(ard_num_dims=D))`` with every lengthscale at :math:`\sqrt{D}`, as
    :class:`~gpsd.ARDGPRegressor`'s default kernel."""
    kernel = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(ard_num_dims=train_x.shape[-1])
    ).to(train_x)
    kernel.base_kernel.lengthscale = torch.tensor(
        math.sqrt(train_x.shape[-1]), dtype=train_x.dtype, device=train_x.device
    )
    return kernel


class DPKLRegressor(EmbeddingGPRegressorBase):
    r"""Deep Probabilistic Kernel Learning regressor (Mallick et al., 2021, §3, Algorithm 1).

    An :class:`~gpytorch.models.ExactGP` whose inputs are the latent distributions
    :math:`p(\mathbf{Z}\mid\mathbf{x})` given by ``m`` particles of a feature extractor
    :math:`g_{\mathbf{w}}: \mathbb{R}^D \to \mathbb{R}^d`, with the kernel between distributions

    .. math::

        \hat{K}(\mathbf{x}, \mathbf{x}') = \frac{1}{m^2}\sum_{l,l'}
        k\big(g_{\mathbf{w}_l}(\mathbf{x}), g_{\mathbf{w}_{l'}}(\mathbf{x}')\big)
        \approx \bar{\boldsymbol\phi}(\mathbf{x})^\top \bar{\boldsymbol\phi}(\mathbf{x}'),

    (``embedding_kernel="rff"``: random Fourier features, or orthogonal ones with ``orthogonal=True``, as a
    low-rank operator solved by Woodbury in :math:`O(nR^2)`; ``embedding_kernel="exact"``: the exact
    expected kernel, :math:`O(n^2m^2)`). The likelihood is Gaussian with a learned noise; the mean
    is a learned constant; the base kernel's lengthscale and outputscale are learned. The particles
    are trained by the functional gradient of the negative log marginal likelihood
    :math:`\hat{L}` (see :meth:`fit`): ``update="paper"`` is Prop. 1
    (:math:`\sum_l \kappa(\mathbf{w}, \mathbf{w}_l)\nabla_{\mathbf{w}_l}\hat{L}`), ``update="svgd"``
    adds SVGD's repulsive term :math:`-\tfrac{1}{m}\sum_l \nabla_{\mathbf{w}_l}\kappa(\mathbf{w}_l,
    \mathbf{w})` (:class:`~gpsd.dpkl.SteinVariationalGradient` with ``loss_type="joint"``).

    **The default adds an ARD kernel on the raw inputs** (``input_kernel="ard"``):

    .. math::

        K(\mathbf{x}, \mathbf{x}') = s_{\text{in}} \exp\Big(-\tfrac12 \sum_j
            \frac{(x_j - x'_j)^2}{h_j^2}\Big) + \hat{K}(\mathbf{x}, \mathbf{x}')

    (:class:`~gpsd.dpkl.InputPlusEmbeddingKernel`, dense, :math:`O(n^3)`), and :meth:`fit`
    holds out 20 % of the rows, fits the ARD GP alone on the other 80 %, trains the network
    from there with early stopping on the held-out rows, where the check before the first step
    is the ARD GP itself, and refits the chosen model (:attr:`network_kept_`) on all the rows:
    the network is kept only where rows that neither the warm start nor the training saw say
    that it helps
    (``benchmarks/results/dpkl_default_choice.md``).
    The paper's model and training, which overfit on small data, are
    :meth:`paper_setting` (or ``input_kernel=None``).

    Train it with :meth:`fit` (which returns the model); :meth:`predict` gives the latent
    posterior (``include_noise=True``: of the observations) as a :class:`~gpsd.Prediction`, and
    ``model(test_x)`` in evaluation mode the latent ``MultivariateNormal``; both raise
    :class:`~gpsd.NotFittedError` before :meth:`fit`. A feature extractor that produces NaN or
    inf embeddings raises a ``ValueError`` that names it (in :meth:`fit`, with the iteration).

    :param train_x: ``(n, D)`` training inputs, or ``(n,)`` for one input feature.
    :param train_y: ``(n,)`` training targets (standardise them).
    :param feature_extractor: a network mapping ``(n, D)`` to ``(n, latent_dim)`` (copied and
        re-initialised per particle) or a callable returning a fresh one.
    :param num_particles: :math:`m \ge 1`.
    :param latent_dim: :math:`d`, checked against the network's output width.
    :param num_random_features: :math:`R \ge 1` (``2R`` features).
    :param embedding_kernel: ``"rff"`` (random Fourier features) or ``"exact"``, the kernel
        between the embeddings.
    :param orthogonal: orthogonal random features (Yu et al., 2016).
    :param nu: ``None`` (RBF base kernel) or a Matérn smoothness in {0.5, 1.5, 2.5}.
    :param update: ``"paper"`` or ``"svgd"``.
    :param repulsion: weight of the repulsive term (default ``None``: 0 for ``"paper"``, 1 for
        ``"svgd"``, following :attr:`update` if it is changed later).
    :param bandwidth: ``"median"`` (:math:`h = \mathrm{med}^2/\log m`) or a fixed :math:`h`.
    :param input_kernel: the kernel on the raw inputs added to the embedding kernel: ``"ard"``
        (default: ``ScaleKernel(RBFKernel(ard_num_dims=D))`` with lengthscales starting at
        :math:`\sqrt{D}`), a GPyTorch kernel of your own, or ``None`` for the paper's kernel
        alone.
    :param likelihood: a :class:`~gpytorch.likelihoods.GaussianLikelihood` (default: a new one).
    :param mean_module: the prior mean, a GPyTorch ``Mean`` (default: a learned constant).
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        feature_extractor: nn.Module | Callable[[], nn.Module],
        *,
        num_particles: int = 10,
        latent_dim: int = 2,
        num_random_features: int = 100,
        embedding_kernel: Literal["rff", "exact"] = "rff",
        orthogonal: bool = False,
        nu: float | None = None,
        update: Literal["paper", "svgd"] = "paper",
        repulsion: float | None = None,
        bandwidth: float | Literal["median"] = "median",
        input_kernel: gpytorch.kernels.Kernel | Literal["ard"] | None = "ard",
        likelihood: gpytorch.likelihoods.GaussianLikelihood | None = None,
        mean_module: gpytorch.means.Mean | None = None,
    ) -> None:
        train_x = check_inputs(train_x, "train_x")
        if not (
            input_kernel is None
            or isinstance(input_kernel, gpytorch.kernels.Kernel)
            or (isinstance(input_kernel, str) and input_kernel == "ard")
        ):
            raise TypeError(
                "input_kernel must be 'ard', None (the paper's kernel) or a gpytorch Kernel, "
                f"got {input_kernel!r}"
            )
        super().__init__(train_x, train_y, likelihood, mean_module)
        latent_dim = check_int(latent_dim, "latent_dim")
        if embedding_kernel not in ("rff", "exact"):
            raise ValueError(f"embedding_kernel must be 'rff' or 'exact', got {embedding_kernel!r}")
        # checked by the setters, before the ensemble is built
        self.update, self.repulsion, self.bandwidth = update, repulsion, bandwidth
        if nu is not None and nu not in (0.5, 1.5, 2.5):  # before either kernel is built
            raise ValueError(f"nu must be None (RBF) or one of 0.5, 1.5, 2.5, got {nu!r}")
        ensemble = ParticleEnsemble(feature_extractor, num_particles).to(train_x)
        try:
            # in evaluation mode: BatchNorm in training mode refuses one row, and would fold
            # it into its running statistics
            with torch.no_grad():
                width = ensemble.eval()(train_x[:1]).shape[-1]
        except (RuntimeError, ValueError) as err:
            raise ValueError(
                f"train_x with {train_x.shape[-1]} features does not fit the feature extractor: "
                f"{err}"
            ) from err
        finally:
            ensemble.train()
        if width != latent_dim:
            raise ValueError(
                f"the feature extractor maps to {width} dimensions but latent_dim is {latent_dim}"
            )
        if embedding_kernel == "rff":
            random_features = RandomFeatureKernel(
                num_random_features, latent_dim, nu=nu, orthogonal=orthogonal
            )
            self.covar_module = ProbabilisticEmbeddingKernel(ensemble, random_features)
        else:
            base = (
                gpytorch.kernels.RBFKernel() if nu is None else gpytorch.kernels.MaternKernel(nu=nu)
            )
            self.covar_module = ExpectedEmbeddingKernel(
                ensemble, gpytorch.kernels.ScaleKernel(base), latent_dim=latent_dim
            )
        if input_kernel is not None:
            if isinstance(input_kernel, str):
                input_kernel = ard_kernel(train_x)
            self.covar_module = InputPlusEmbeddingKernel(input_kernel, self.covar_module)
        self.to(train_x)
        self.kernel_type = embedding_kernel
        self._default_val_fraction = 0.0 if input_kernel is None else 0.2

    @property
    def input_kernel(self) -> gpytorch.kernels.Kernel | None:
        """The kernel on the raw inputs added to the embedding kernel, or ``None`` (the paper's
        kernel)."""
        return getattr(self.covar_module, "input_kernel", None)

    @property
    def embedding_kernel(self) -> ProbabilisticEmbeddingKernel | ExpectedEmbeddingKernel:
        """The kernel between the latent distributions (it holds the particle ensemble)."""
        return getattr(self.covar_module, "embedding_kernel", self.covar_module)

    #: The embedding kernel's outputscale after the warm start, as a fraction of the input
    #: kernel's (the network starts as a small correction to the ARD GP).
    embedding_scale_ratio: float = 0.01

    #: Whether the last :meth:`fit` kept a trained network (``True``) or chose the warm-started
    #: ARD GP plus the small embedding kernel (``False``); see :meth:`fit`. ``None`` before it.
    network_kept_: bool | None = None

    @classmethod
    def paper_setting(
        cls,
        train_x: Tensor,
        train_y: Tensor,
        feature_extractor: nn.Module | Callable[[], nn.Module],
        **kwargs,
    ) -> DPKLRegressor:
        r"""The model and training of Mallick et al. (§3, Algorithm 1, Appendix C.1): the kernel
        between latent distributions alone (``input_kernel=None``), :math:`m = 10` particles,
        :math:`R = 100` random Fourier features, the paper's functional gradient
        (``update="paper"``), and a :meth:`fit` that holds out 10 % of the rows for early
        stopping (``val_fraction=0.1``), with no warm start.

        It is the paper's algorithm, kept to reproduce it: on small data it overfits and loses
        to a plain ARD GP (``benchmarks/results/dpkl_defaults.md``); the default
        ``DPKLRegressor(train_x, train_y, feature_extractor)`` does not.

        :param train_x: ``(n, D)`` training inputs, or ``(n,)`` for one input feature.
        :param train_y: ``(n,)`` training targets (standardise them).
        :param feature_extractor: as in :class:`DPKLRegressor` (the paper's is
            ``D-100-50-50-2`` with ReLU).
        :param kwargs: the other keywords of :class:`DPKLRegressor` (``latent_dim``, ``nu``,
            ``likelihood``, ``mean_module``, ...); not those that make the setting
            (``num_particles``, ``num_random_features``, ``embedding_kernel``, ``update``,
            ``input_kernel``).
        """
        fixed = {
            "num_particles": 10,
            "num_random_features": 100,
            "embedding_kernel": "rff",
            "update": "paper",
            "input_kernel": None,
        }
        for name in fixed.keys() & kwargs.keys():
            raise ValueError(
                f"paper_setting fixes {name}={fixed[name]!r}; build DPKLRegressor(...) directly "
                f"to change it"
            )
        model = cls(train_x, train_y, feature_extractor, **fixed, **kwargs)
        model._default_val_fraction = 0.1
        return model

    def fit(
        self,
        *,
        max_iter: int = 200,
        lr: float = 1e-2,
        val_x: Tensor | None = None,
        val_y: Tensor | None = None,
        val_fraction: float | None = None,
        warm_start_iter: int = 300,
        check_every: int = 10,
        optimizer: torch.optim.Optimizer | None = None,
        progress: object = False,
        callback: Callback | None = None,
    ) -> DPKLRegressor:
        r"""Train the model; with the default input kernel, so that it starts from the ARD GP
        and keeps the network only where held-out rows say it helps.

        With an :attr:`input_kernel` (the default):

        1. **Validation rows**: without ``val_x``/``val_y``, a random ``val_fraction`` of the
           training rows (default 0.2, at least one; ``torch.randperm``, so
           ``torch.manual_seed`` fixes it) is held out, if there are at least 10 rows. Steps 2
           and 3 see only the other rows.
        2. **Warm start**: the input kernel, the noise and the mean are fitted alone, as
           :class:`~gpsd.ARDGPRegressor` (``warm_start_iter`` Adam steps at lr 0.1); the
           embedding kernel's outputscale is then set to :attr:`embedding_scale_ratio` times
           the input kernel's.
        3. **Training**: every parameter (the particles by the functional gradient, the
           kernels' hyperparameters, the noise and the mean by their ordinary gradient) follows
           the loop of the paper's training (below); the validation NLL is checked before the
           first iteration and every ``check_every`` iterations, and the best checked state is
           restored (early stopping). The check before the first iteration is the
           warm-started ARD GP (plus the small embedding kernel), the check after iteration
           :math:`k > 0` the network trained for :math:`k` iterations: the network is kept
           (:attr:`network_kept_`) only if it lowers the NLL of rows that neither the warm
           start nor the training saw.
        4. **Refit** (when step 1 held rows out): the model goes back to the state it had when
           ``fit`` was called and steps 2 and 3 run again on all the rows, without validation,
           for the chosen number :math:`k` of training iterations (0 where the ARD GP was
           chosen). The model conditions on all the rows it was given (``train_inputs`` are the
           rows given to the constructor again).

        The training loop is that of Algorithm 1: every iteration, ``loss =
        self.training_loss()``; ``loss.backward()``; the particles' gradients of the total
        negative log marginal likelihood :math:`\hat L` are transformed by
        :class:`~gpsd.dpkl.SteinVariationalGradient` with this model's :attr:`bandwidth` and
        :attr:`repulsion` (0 for :attr:`update` ``"paper"``: Prop. 1; 1 for ``"svgd"``) and
        divided by :math:`n` again; then ``optimizer.step()``.

        Without an input kernel (``input_kernel=None``, :meth:`paper_setting`) there is no warm
        start and every parameter trains from its initial value, as in the paper; rows are held
        out only with ``val_fraction`` (:meth:`paper_setting`: 0.1) or ``val_x``/``val_y``,
        early stopping picks the state, and the model then conditions on all the rows without
        a refit. With ``val_x``/``val_y`` there is no refit either: the training rows are
        already all the rows.

        What was recorded is in :attr:`history`: of steps 2 and 3, ``"loss"``, ``"val_nll"``,
        ``"val_iteration"`` and ``"warm_start_loss"`` (the warm start's loss per step); of
        the refit, ``"refit_warm_start_loss"`` and ``"refit_loss"`` (empty without one). The
        choice is :attr:`network_kept_`: ``True`` where the best check came after the first
        training iteration (without validation rows: where training ran at all).

        :param max_iter: Training iterations after the warm start, ``>= 0``.
        :param lr: Adam's learning rate in training (unused with ``optimizer``).
        :param val_x: ``(n_v, D)`` validation inputs (with ``val_y``), or ``None``.
        :param val_y: ``(n_v,)`` validation targets.
        :param val_fraction: The fraction of training rows held out when no ``val_x`` is given,
            in ``[0, 1)``; ``None``: 0.2 with an input kernel, 0.1 for :meth:`paper_setting`,
            else 0 (no early stopping).
        :param warm_start_iter: Adam steps of the warm start (with an input kernel), ``>= 0``.
        :param check_every: Iterations between validation checks.
        :param optimizer: An optimiser over the parameters to train (default: Adam over those
            that require a gradient).
        :param progress: ``True`` for a ``tqdm`` bar per phase (the warm start, the training,
            the refit's two), or a bar of your own, advanced by all (:mod:`gpsd.progress`).
        :param callback: Called after each step of the warm start and each training iteration
            with an :class:`~gpsd.IterationRecord` whose ``phase`` is ``"warm start"``,
            ``"training"``, ``"refit warm start"`` or ``"refit training"`` (``iteration`` and
            ``total`` count within the phase); returning ``True`` stops the fit, without a
            refit: in the warm start, the model is the warm-started ARD GP (plus the small
            embedding kernel), without training.
        :returns: ``self``, fitted and in evaluation mode.
        :raises ValueError: a bad argument (named), or a feature extractor that produced NaN or
            inf embeddings.
        """
        # every argument is checked before the warm start trains anything
        check_progress(progress, callback)
        max_iter = check_int(max_iter, "max_iter", minimum=0)
        warm_start_iter = check_int(warm_start_iter, "warm_start_iter", minimum=0)
        lr = check_positive_float(lr, "lr")
        check_every = check_int(check_every, "check_every")
        if (val_x is None) != (val_y is None):
            raise ValueError("val_x and val_y must be given together")
        x, y = self.train_inputs[0], self.train_targets
        if val_x is not None:
            val_x = check_inputs(val_x, "val_x", x.shape[-1], like=x)
            val_y = check_targets(val_y, "val_y", val_x.shape[0], x)
        if val_fraction is not None and val_x is not None:
            raise ValueError("give val_x/val_y or val_fraction, not both")
        if val_fraction is None:
            val_fraction = 0.0 if val_x is not None else self._default_val_fraction
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, Real):
            raise TypeError(f"val_fraction must be a real number, got {val_fraction!r}")
        val_fraction = float(val_fraction)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        n = x.shape[0]
        task = f"{type(self).__name__}.fit"
        if optimizer is None:
            optimizer = torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=lr)
        held_out = val_fraction > 0 and n >= _MIN_ROWS_TO_SPLIT
        refit = held_out and self.input_kernel is not None
        if refit:  # the refit starts where this fit starts
            start = copy.deepcopy(self.state_dict()), copy.deepcopy(optimizer.state_dict())
        if held_out:
            n_val = min(n - 1, max(1, round(val_fraction * n)))
            perm = torch.randperm(n, device=x.device)
            val_x, val_y = x[perm[:n_val]], y[perm[:n_val]]
            self.set_train_data(x[perm[n_val:]], y[perm[n_val:]], strict=False)
        try:
            warm_loss, stopped = self._train(
                task,
                max_iter,
                val_x,
                val_y,
                warm_start_iter,
                check_every,
                optimizer,
                progress,
                callback,
                ("warm start", "training"),
            )
        finally:
            if held_out:
                self.set_train_data(x, y, strict=False)
        history = {**self.history, "warm_start_loss": warm_loss}
        checked = history["val_iteration"]
        best = (
            checked[min(range(len(checked)), key=history["val_nll"].__getitem__)]
            if checked
            else len(history["loss"])
        )
        self.network_kept_ = best > 0
        history["refit_warm_start_loss"], history["refit_loss"] = [], []
        if refit and not stopped:
            self.load_state_dict(start[0])
            optimizer.load_state_dict(start[1])
            history["refit_warm_start_loss"], _ = self._train(
                task,
                best,
                None,
                None,
                warm_start_iter,
                check_every,
                optimizer,
                progress,
                callback,
                ("refit warm start", "refit training"),
            )
            history["refit_loss"] = self.history["loss"]
        self.history = history
        return self

    def _train(
        self,
        task: str,
        max_iter: int,
        val_x: Tensor | None,
        val_y: Tensor | None,
        warm_start_iter: int,
        check_every: int,
        optimizer: torch.optim.Optimizer,
        progress: object,
        callback: Callback | None,
        phases: tuple[str, str],
    ) -> tuple[list[float], bool]:
        """The warm start (with an input kernel) and the training on the current training rows,
        reported in ``phases`` (the warm start's, the training's); returns the warm start's loss
        per step and whether the callback stopped either."""
        warm_loss: list[float] = []
        stopped = False
        if self.input_kernel is not None and warm_start_iter > 0:
            with ProgressReporter(
                task, warm_start_iter, progress, callback, phase=phases[0]
            ) as reporter:
                warm_loss = self._warm_start(warm_start_iter, reporter)
            stopped = reporter.stopped
        reporter = ProgressReporter(
            task, 0 if stopped else max_iter, progress, callback, phase=phases[1]
        )
        self._fit_loop(0 if stopped else max_iter, val_x, val_y, check_every, optimizer, reporter)
        return warm_loss, stopped or reporter.stopped

    def _warm_start(self, max_iter: int, reporter: ProgressReporter) -> list[float]:
        """Fit the input kernel, the noise and the mean alone on the current training rows (an ARD GP
        sharing these modules; each step reported to ``reporter``), then set the embedding
        kernel's outputscale to :attr:`embedding_scale_ratio` times the input kernel's; returns
        the loss per step."""
        gp = ARDGPRegressor(
            self.train_inputs[0],
            self.train_targets,
            covar_module=self.input_kernel,
            mean_module=self.mean_module,
            likelihood=self.likelihood,
        )
        optimizer = torch.optim.Adam(gp.parameters(), lr=0.1)
        gp._fit_loop(max_iter, None, None, 10, optimizer, reporter)
        scale = getattr(self.input_kernel, "outputscale", None)
        scale = 1.0 if scale is None else scale.detach()
        emb = self.embedding_kernel
        scaled = (
            emb.random_features
            if isinstance(emb, ProbabilisticEmbeddingKernel)
            else emb.base_kernel
        )
        if hasattr(scaled, "outputscale"):
            scaled.outputscale = self.embedding_scale_ratio * scale
        self.train()
        return gp.history["loss"]

    @property
    def num_particles(self) -> int:
        """The number :math:`m` of particles."""
        return self.covar_module.feature_extractor.num_particles

    @torch.no_grad()
    def embed(self, x: Tensor) -> Tensor:
        """Latent embeddings of ``x`` (``(n, D)`` or ``(n,)``) by every particle:
        ``(m, n, latent_dim)``.

        The networks run in evaluation mode (no dropout, BatchNorm's running statistics used
        and left alone), whatever mode the model is in, as in :meth:`predict`.
        """
        x = check_inputs(x, "x", self.train_inputs[0].shape[-1], like=self.train_inputs[0])
        extractor = self.covar_module.feature_extractor
        was_training = extractor.training
        extractor.eval()
        try:
            return self.covar_module.latent_embeddings(x)
        finally:
            extractor.train(was_training)

    def latent_posterior_variance(self, x: Tensor) -> Tensor:
        r"""Posterior variance of the latent :math:`f` at ``x`` given the training data, with grad.

        .. math::

            \sigma^2(\mathbf{x}) = k_{\star\star} - \mathbf{k}_\star^\top(\hat{\mathbf K} +
            \sigma_\eta^2\mathbf I)^{-1}\mathbf{k}_\star,
            \qquad k_{\star\star} = \hat K(\mathbf{x}, \mathbf{x}),

        for ``embedding_kernel="rff"`` (where :math:`k_{\star\star} = \lVert\bar{\boldsymbol\phi}(\mathbf{x})
        \rVert^2`) in the Woodbury form :math:`\sigma_\eta^2\, \bar{\boldsymbol\phi}^\top
        (\bar{\boldsymbol\Phi}^\top \bar{\boldsymbol\Phi} + \sigma_\eta^2 \mathbf I)^{-1}
        \bar{\boldsymbol\phi}`, :math:`O(nR^2)`.

        It runs in the model's current mode, with one pass of the feature extractor over the
        training inputs and ``x`` together, so that :math:`k_{\star\star}`,
        :math:`\mathbf{k}_\star` and :math:`\hat{\mathbf K}` are blocks of one kernel matrix and
        :math:`\sigma^2 \ge 0`. In training mode each row's embeddings are drawn once (one
        dropout draw, used in every block) and BatchNorm normalises all the rows as one batch
        (and updates its running statistics once); in evaluation mode the result is
        deterministic.
        """
        train_x = self.train_inputs[0]
        x = check_inputs(x, "x", train_x.shape[-1], like=train_x)
        return self._posterior_variance(
            self.covar_module.features(torch.cat([train_x, x])), train_x.shape[0]
        )

    def _posterior_variance(self, features: Tensor, n: int) -> Tensor:
        """:meth:`latent_posterior_variance` at the rows after the first ``n`` of ``features``
        (an output of the kernel's ``features``), given the first ``n`` as the training rows."""
        noise = self.likelihood.noise.squeeze(-1)
        train, query = features[..., :n, :], features[..., n:, :]
        if self.kernel_type == "rff" and self.input_kernel is None:  # (n, 2R), (n_x, 2R)
            a = train.mT @ train + noise * torch.eye(
                train.shape[-1], dtype=train.dtype, device=train.device
            )
            chol = torch.linalg.cholesky(a)
            v = torch.linalg.solve_triangular(chol, query.mT, upper=False)  # shape: (2R, n_x)
            return noise * v.pow(2).sum(0)
        covariance = self.covar_module.feature_covariance
        k_xx = covariance(query, diag=True)
        k_xt = drop_negligible(covariance(query, train))  # shape: (n_x, n)
        k_tt = drop_negligible(covariance(train))
        k_tt = k_tt + noise * torch.eye(n, dtype=k_tt.dtype, device=k_tt.device)
        chol = torch.linalg.cholesky(k_tt)
        v = torch.linalg.solve_triangular(chol, k_xt.mT, upper=False)
        return k_xx - v.pow(2).sum(0)
