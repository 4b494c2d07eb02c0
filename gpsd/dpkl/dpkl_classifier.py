"""DPKL classifier: Bayesian logistic regression on probabilistic embeddings (§3.3)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Literal

import gpytorch
import torch
from gpytorch.constraints import Positive
from torch import Tensor, nn

from gpsd import settings
from gpsd._internal.module_state import checked_setting
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.validation import as_float_tensor, check_finite, check_int, check_positive_float
from gpsd.dpkl.particle_ensemble import ParticleEnsemble
from gpsd.dpkl.svgd import SteinVariationalGradient, check_bandwidth, check_update
from gpsd.exceptions import NotFittedError
from gpsd.prediction import Prediction
from gpsd.progress import Callback

__all__ = ["DPKLClassifier"]


class DPKLClassifier(gpytorch.Module):
    r"""Kernel-normalised Bayesian logistic regression on probabilistic embeddings (Mallick §3.3).

    With embedding particles :math:`\mathbf{w}_1, \dots, \mathbf{w}_m` and class-weight particles
    :math:`\boldsymbol\theta^{(1)}, \dots, \boldsymbol\theta^{(q)} \in \mathbb{R}^{C \times d}`
    (samples of :math:`q(\boldsymbol\theta)`), the class probabilities are

    .. math::

        \rho^{(j)}_{ic} = \frac{\frac1m\sum_l k\big(g_{\mathbf{w}_l}(\mathbf{x}_i),
            \boldsymbol\theta^{(j)}_c\big)}{\sum_{c'} \frac1m\sum_l
            k\big(g_{\mathbf{w}_l}(\mathbf{x}_i), \boldsymbol\theta^{(j)}_{c'}\big)},
        \qquad k(\mathbf{z}, \boldsymbol\theta) = \exp\!\big(-\lVert\mathbf{z} -
            \boldsymbol\theta\rVert^2 / 2\ell^2\big),

    computed exactly in log space (``logsumexp``; it costs :math:`O(nmqCd)`, no random features
    are needed since no :math:`n \times n` matrix appears), and the prediction is
    :math:`\bar\rho_{ic} = \frac1q\sum_j \rho^{(j)}_{ic}`. Training (:meth:`fit`, minibatches):

    * embedding particles and the lengthscale :math:`\ell`: the cross entropy of eq. 17,
      :math:`L = -\sum_i \log \bar\rho_{i y_i}`, through the functional gradient
      (``update="paper"``: Prop. 1; ``"svgd"``: with the repulsive term);
    * class weights: SVGD (Liu & Wang, 2016; ``loss_type="per_particle"``, repulsion 1) on the
      posterior :math:`p(\boldsymbol\theta \mid \mathcal D) \propto \prod_i \rho_{i y_i}(\boldsymbol\theta)
      \, \mathcal N(\boldsymbol\theta; 0, \sigma_\theta^2 \mathbf I)`.

    With ``num_particles=1`` the embedding is deterministic (the "DBLR" baseline of the paper).

    Train it with :meth:`fit` (which returns the classifier); then :meth:`predict_proba` gives
    :math:`\bar\rho` of shape ``(M, C)``, :meth:`predict` the labels ``(M,)`` and
    :meth:`predict_latent` the class scores (logits) as a :class:`~gpsd.Prediction`. All of them
    raise :class:`~gpsd.NotFittedError` before :meth:`fit` (or ``load_state_dict`` of a trained
    state).

    :param train_x: ``(n, D)`` training inputs, or ``(n,)`` for one input feature; converted to
        the feature extractor's dtype and device.
    :param train_y: ``(n,)`` integer class labels in :math:`0, \dots, C - 1`.
    :param feature_extractor: a network ``(n, D) -> (n, latent_dim)`` or a callable returning one.
    :param num_classes: :math:`C \ge 2` (default: ``train_y.max() + 1``).
    :param num_particles: :math:`m \ge 1` embedding particles.
    :param num_weight_particles: :math:`q \ge 1` class-weight particles.
    :param latent_dim: :math:`d`, checked against the network on the training inputs; by default
        the width of the network's output. The width matters: on digits (64 pixels, 50 to 100
        labelled points) a 16-wide embedding was far more accurate than a 2-wide one, which lost
        to logistic regression; on spam (6 features) the 2-wide one had the lower log loss
        (``benchmarks/results/dpkl_classifier_baselines.md``).
    :param prior_std: :math:`\sigma_\theta` of the Gaussian prior on the class weights.
    :param update: ``"paper"`` or ``"svgd"`` for the embedding particles.
    :param bandwidth: the Stein kernel bandwidth of both particle sets: ``"median"`` (the median
        heuristic, see :class:`~gpsd.dpkl.SteinVariationalGradient`) or a fixed positive :math:`h`.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        feature_extractor: nn.Module | Callable[[], nn.Module],
        *,
        num_classes: int | None = None,
        num_particles: int = 10,
        num_weight_particles: int = 10,
        latent_dim: int | None = None,
        prior_std: float = 1.0,
        update: Literal["paper", "svgd"] = "paper",
        bandwidth: float | Literal["median"] = "median",
    ) -> None:
        super().__init__()
        if num_classes is not None:
            num_classes = check_int(num_classes, "num_classes", minimum=2)
        num_weight_particles = check_int(num_weight_particles, "num_weight_particles")
        latent_dim = check_int(latent_dim, "latent_dim", optional=True)
        prior_std = check_positive_float(prior_std, "prior_std")
        # checked by the setters, before the ensemble is built
        self.update, self.bandwidth = update, bandwidth
        self.feature_extractor = ParticleEnsemble(feature_extractor, num_particles)
        # the extractor's dtype and device (ParticleEnsemble holds a parameter or a buffer)
        tensors = [*self.feature_extractor.parameters(), *self.feature_extractor.buffers()]
        floating = [t for t in tensors if t.is_floating_point()]
        like = {
            "dtype": floating[0].dtype if floating else torch.get_default_dtype(),
            "device": tensors[0].device,
        }
        train_x = self._as_inputs(train_x, "train_x", **like)
        if train_x.shape[0] < 1:
            raise ValueError("train_x must hold at least 1 row, got 0")
        train_y = self._as_labels(train_y, train_x.shape[0], "train_y", device=like["device"])
        if num_classes is None:
            num_classes = int(train_y.max()) + 1
            if num_classes < 2:
                raise ValueError(
                    "num_classes must be at least 2; train_y holds the label 0 alone, so pass "
                    "num_classes to say how many classes there are"
                )
        if int(train_y.max()) >= num_classes:
            raise ValueError(f"train_y must hold labels in 0..{num_classes - 1}")
        self.num_classes = num_classes
        if latent_dim is None:  # the network's output width
            self._check_input_width(train_x, "train_x", check_latent=False)
            latent_dim = int(self._evaluate(lambda: self.feature_extractor(train_x[:1])).shape[-1])
        self.latent_dim = latent_dim
        self.prior_std = prior_std
        # data, as ExactGP's train_inputs: follows .to() but stays out of state_dict()
        self.register_buffer("train_x", train_x, persistent=False)
        self.register_buffer("train_y", train_y, persistent=False)
        self.class_weights = nn.Parameter(
            torch.randn(num_weight_particles, num_classes, latent_dim, **like) * prior_std
        )  # shape: (q, C, d)
        # lengthscale 1, not through the setter: GPyTorch's initialize() reads the value, which
        # a tensor on the meta device cannot give
        constraint = Positive()
        raw = constraint.inverse_transform(torch.ones((), **like))
        self.register_parameter("raw_lengthscale", nn.Parameter(raw))
        self.register_constraint("raw_lengthscale", constraint)
        self._check_input_width(train_x, "train_x")
        self._fitted = False
        #: The record of the last :meth:`fit`: ``"loss"``, the mean eq. 17 loss of each epoch;
        #: ``"val_accuracy"`` and ``"val_nll"``, the validation accuracy and NLL of each check;
        #: ``"val_iteration"``, the epoch after which each check was made (0: before the first).
        self.history: dict[str, list[float]] = {
            "loss": [],
            "val_accuracy": [],
            "val_nll": [],
            "val_iteration": [],
        }
        self.register_load_state_dict_post_hook(_mark_fitted)

    update = checked_setting(
        "update",
        check_update,
        """The embedding particles' functional gradient in :meth:`fit`: ``"paper"`` (repulsion 0)
        or ``"svgd"`` (repulsion 1).""",
    )
    bandwidth = checked_setting(
        "bandwidth",
        check_bandwidth,
        """The Stein kernel bandwidth of both particle sets: ``"median"`` or a positive float.""",
    )

    @property
    def lengthscale(self) -> Tensor:
        return self.raw_lengthscale_constraint.transform(self.raw_lengthscale)

    @lengthscale.setter
    def lengthscale(self, value: float | Tensor) -> None:
        # 0 would be stored as raw -inf, and every prediction would be NaN
        value = check_positive_float(value, "lengthscale")
        # read in the parameter's dtype: torch.as_tensor(0.7) would be float32, and 0.7 would
        # become 0.699999988079071 in a float64 model
        raw = self.raw_lengthscale
        value = torch.as_tensor(value, dtype=raw.dtype, device=raw.device)
        self.initialize(raw_lengthscale=self.raw_lengthscale_constraint.inverse_transform(value))

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _as_inputs(x: object, name: str, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``x`` as a finite ``(n, D)`` tensor of ``dtype`` on ``device`` (``(n,)``: one feature)."""
        x = as_float_tensor(x, name, dtype=dtype, device=device)
        if x.dim() == 1:
            x = x.unsqueeze(-1)
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape (n, D) or (n,), got shape {tuple(x.shape)}")
        return check_finite(x, name)

    @staticmethod
    def _as_labels(y: object, n: int, name: str, *, device: torch.device) -> Tensor:
        """``y`` as ``(n,)`` non-negative integer labels (a ``long`` tensor on ``device``)."""
        y = torch.as_tensor(y, device=device)
        if y.is_floating_point():
            if not (torch.isfinite(y).all() and torch.equal(y, y.round())):
                raise ValueError(f"{name} must hold integer class labels")
        y = y.long()
        if y.dim() != 1 or y.shape[0] != n:
            raise ValueError(f"{name} must have shape ({n},), got shape {tuple(y.shape)}")
        if (y < 0).any():
            raise ValueError(f"{name} must hold non-negative class labels")
        return y

    def _check_x(self, x: object, name: str = "x") -> Tensor:
        ref = self.class_weights
        return self._as_inputs(x, name, dtype=ref.dtype, device=ref.device)

    def _check_query(self, x: object, name: str = "x", min_rows: int = 0) -> Tensor:
        """``_check_x`` plus a row count and the feature extractor's input width."""
        x = self._check_x(x, name)
        if x.shape[0] < min_rows:
            raise ValueError(f"{name} must hold at least {min_rows} row(s), got {x.shape[0]}")
        if x.shape[0] > 0:
            self._check_input_width(x, name)
        return x

    def _check_y(self, y: object, n: int, name: str = "y") -> Tensor:
        y = self._as_labels(y, n, name, device=self.class_weights.device)
        if (y >= self.num_classes).any():
            raise ValueError(f"{name} must hold labels in 0..{self.num_classes - 1}")
        return y

    def _check_fitted(self, what: str) -> None:
        if not self._fitted:
            raise NotFittedError(
                f"DPKLClassifier is not fitted: call fit() (or load_state_dict() with a trained "
                f"state) before {what}"
            )

    # ------------------------------------------------------------------ model
    def embed(self, x: Tensor) -> Tensor:
        """Latent embeddings by every particle: ``(m, n, latent_dim)``."""
        z = self.feature_extractor(x)
        if z.shape[-1] != self.latent_dim:
            raise ValueError(
                f"the feature extractor maps to {z.shape[-1]} dimensions but latent_dim is "
                f"{self.latent_dim}"
            )
        return z

    def log_kernel_means(self, x: Tensor) -> Tensor:
        r"""The class scores (logits) :math:`f^{(j)}_{ic} = \log \frac1m\sum_l
        k\big(g_{\mathbf{w}_l}(\mathbf{x}_i), \boldsymbol\theta^{(j)}_c\big)` for every
        class-weight particle: ``(q, n, C)``, with grad, in the current mode;
        :math:`\rho^{(j)}_{i\cdot} = \operatorname{softmax}(f^{(j)}_{i\cdot})`.

        The differences :math:`\mathbf z - \boldsymbol\theta` are formed exactly (no
        :math:`\lVert\mathbf z\rVert^2 - 2\mathbf z^\top\boldsymbol\theta +
        \lVert\boldsymbol\theta\rVert^2` cancellation) in row chunks of at most
        :class:`gpsd.settings.max_chunk_elements` entries, so that a large test set does not
        build one ``(q, m, n, C, d)`` tensor.
        """
        x = self._check_x(x)
        z = self.embed(x)  # shape: (m, n, d)
        theta = self.class_weights  # shape: (q, C, d)
        q, num_classes, d = theta.shape
        m = z.shape[0]
        rows = max(1, settings.max_chunk_elements.value() // (q * m * num_classes * d))
        two_l2 = 2 * self.lengthscale**2
        return torch.cat(
            [
                torch.logsumexp(
                    -(zc.unsqueeze(0).unsqueeze(-2) - theta.unsqueeze(1).unsqueeze(1))
                    .pow(2)
                    .sum(-1)  # shape: (q, m, rows, C)
                    / two_l2,
                    dim=1,
                )
                for zc in z.split(rows, dim=1)
            ],
            dim=1,
        ) - math.log(m)  # shape: (q, n, C)

    def log_class_probabilities(self, x: Tensor) -> Tensor:
        r""":math:`\log\rho^{(j)}_{ic}` for every class-weight particle: ``(q, n, C)``, with
        grad, in the current mode (see :meth:`log_kernel_means`)."""
        log_k = self.log_kernel_means(x)
        return log_k - torch.logsumexp(log_k, dim=-1, keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        r"""Predicted class probabilities :math:`\bar\rho`: ``(n, C)``, with grad, in the
        current mode (:meth:`predict_proba`: without grad, in evaluation mode)."""
        self._check_fitted("calling the model")
        log_p = self.log_class_probabilities(x)
        return torch.logsumexp(log_p, 0).sub(math.log(log_p.shape[0])).exp()

    def _evaluate(self, fn: Callable[[], Tensor]) -> Tensor:
        """``fn()`` without autograd and in evaluation mode (dropout off), restoring the mode."""
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                return fn()
        finally:
            self.train(was_training)

    def predict_proba(self, test_x: Tensor) -> Tensor:
        r"""Predicted class probabilities :math:`\bar\rho` in evaluation mode: ``(M, C)``
        (column ``c`` the probability of class ``c``; ``C = 2`` for two classes).

        :param test_x: ``(M, D)`` inputs, or ``(M,)`` for one feature.
        :raises ~gpsd.NotFittedError: before :meth:`fit`.
        """
        self._check_fitted("predict_proba()")
        x = self._check_query(test_x, "test_x")
        return self._evaluate(lambda: self(x))

    def predict(self, test_x: Tensor) -> Tensor:
        """The most probable class of each input (of :meth:`predict_proba`): ``(M,)``, ``long``.

        :raises ~gpsd.NotFittedError: before :meth:`fit`.
        """
        self._check_fitted("predict()")
        return self.predict_proba(test_x).argmax(-1)

    def predict_latent(self, test_x: Tensor) -> Prediction:
        r"""The class scores :math:`f_{ic}` (:meth:`log_kernel_means`, whose softmax is
        :math:`\rho_{i\cdot}`) over the posterior samples :math:`\boldsymbol\theta^{(1)}, \dots,
        \boldsymbol\theta^{(q)}` of the class weights, in evaluation mode: a
        :class:`~gpsd.Prediction` whose ``mean`` and ``variance`` have shape ``(M, C)``, one
        column per class: :math:`\frac1q\sum_j f^{(j)}_{ic}` and
        :math:`\frac1q\sum_j (f^{(j)}_{ic})^2 - (\frac1q\sum_j f^{(j)}_{ic})^2` (0 for
        ``q = 1``).

        :raises ~gpsd.NotFittedError: before :meth:`fit`.
        """
        self._check_fitted("predict_latent()")
        x = self._check_query(test_x, "test_x")
        f = self._evaluate(lambda: self.log_kernel_means(x))  # shape: (q, M, C)
        mean = f.mean(0)
        return Prediction(mean, (f - mean).pow(2).mean(0))

    def nll(self, x: Tensor, y: Tensor) -> float:
        """Mean cross entropy of the averaged probabilities (the paper's test NLL), in eval mode."""
        self._check_fitted("nll()")
        x = self._check_query(x, min_rows=1)
        y = self._check_y(y, x.shape[0])
        log_p = self._evaluate(lambda: self.log_class_probabilities(x))
        log_bar = torch.logsumexp(log_p, 0) - math.log(log_p.shape[0])
        return float(-log_bar.gather(-1, y.unsqueeze(-1)).mean())

    def accuracy(self, x: Tensor, y: Tensor) -> float:
        """Fraction of rows whose most probable class is ``y``, in evaluation mode."""
        self._check_fitted("accuracy()")
        x = self._check_query(x, min_rows=1)
        y = self._check_y(y, x.shape[0])
        probabilities = self._evaluate(lambda: self.log_class_probabilities(x).exp().mean(0))
        return float((probabilities.argmax(-1) == y).to(x.dtype).mean())

    def losses(self, x: Tensor, y: Tensor, num_data: int) -> tuple[Tensor, Tensor]:
        """(eq. 17 mean cross entropy of the batch, SVGD potential of the class weights)."""
        log_p = self.log_class_probabilities(x)  # shape: (q, b, C)
        picked = log_p.gather(-1, y.view(1, -1, 1).expand(log_p.shape[0], -1, 1)).squeeze(-1)
        q = log_p.shape[0]
        cross_entropy = -(torch.logsumexp(picked, 0) - math.log(q)).mean()
        scale = num_data / x.shape[0]
        potential = -scale * picked.sum(-1) + self.class_weights.pow(2).sum((-1, -2)) / (
            2 * self.prior_std**2
        )  # shape: (q,)
        return cross_entropy, potential.sum()

    # ------------------------------------------------------------------ training
    def fit(
        self,
        *,
        max_iter: int = 100,
        batch_size: int = 32,
        lr: float = 1e-3,
        val_x: Tensor | None = None,
        val_y: Tensor | None = None,
        check_every: int = 10,
        progress: object = False,
        callback: Callback | None = None,
    ) -> DPKLClassifier:
        """Train with Adam on minibatches of the training data for ``max_iter`` epochs; early
        stopping on validation accuracy (then NLL).

        Parameters with ``requires_grad=False`` (the lengthscale, to keep the paper's fixed
        kernel; the class weights; parts of the feature extractor) are not stepped.
        The steps run in training mode (dropout on), the validation checks in evaluation mode;
        the module is left in the mode it was in before. Each epoch visits the rows in a random
        order in minibatches of ``batch_size``; with ``batch_size > 1``, a last minibatch of one
        row joins the one before it (BatchNorm cannot normalise one row in training mode).

        With ``val_x``/``val_y``, the validation accuracy and NLL are checked before the first
        epoch, after every ``check_every`` epochs and after the last, and the best checked state
        (highest accuracy, then lowest NLL) is restored at the end, also when a callback stops
        training. What was recorded is kept in :attr:`history`.

        :param max_iter: Epochs (passes over the training data) to run, ``>= 0``.
        :param batch_size: Rows per minibatch.
        :param lr: Adam's learning rate.
        :param val_x: ``(n_v, D)`` validation inputs (with ``val_y``), or ``None``.
        :param val_y: ``(n_v,)`` validation labels.
        :param check_every: Epochs between validation checks.
        :param progress: ``True`` for a ``tqdm`` bar, or a bar of your own (:mod:`gpsd.progress`).
        :param callback: Called after each epoch with an :class:`~gpsd.IterationRecord`
            (``loss``: the epoch's mean training loss; ``info["val_accuracy"]`` and
            ``info["val_nll"]`` on epochs with a check); returning ``True`` stops training.
        :returns: ``self``, fitted.
        """
        check_progress(progress, callback)
        max_iter = check_int(max_iter, "max_iter", minimum=0)
        batch_size = check_int(batch_size, "batch_size")
        check_every = check_int(check_every, "check_every")
        lr = check_positive_float(lr, "lr")
        x, y = self.train_x, self.train_y
        if (val_x is None) != (val_y is None):
            raise ValueError("val_x and val_y must be given together")
        if val_x is not None:
            val_x = self._check_query(val_x, "val_x", min_rows=1)
            val_y = self._check_y(val_y, val_x.shape[0], "val_y")
        reporter = ProgressReporter("DPKLClassifier.fit", max_iter, progress, callback)
        n = x.shape[0]
        # frozen (requires_grad=False) parameters of the feature extractor are not stepped
        emb_params = [p for p in self.feature_extractor.parameters() if p.requires_grad]
        emb_transform = None
        if emb_params:
            emb_transform = SteinVariationalGradient(
                emb_params,
                bandwidth=self.bandwidth,
                repulsion=1.0 if self.update == "svgd" else 0.0,
                loss_type="joint",
            )
        # frozen class weights or lengthscale (the paper's fixed kernel, say) are not stepped
        theta_transform = None
        if self.class_weights.requires_grad:
            theta_transform = SteinVariationalGradient(
                [self.class_weights],
                bandwidth=self.bandwidth,
                repulsion=1.0,
                loss_type="per_particle",
            )
        hyper = emb_params + [p for p in (self.raw_lengthscale,) if p.requires_grad]
        opt = torch.optim.Adam(self.parameters(), lr=lr)
        history: dict[str, list[float]] = {
            "loss": [],
            "val_accuracy": [],
            "val_nll": [],
            "val_iteration": [],
        }
        self.history = history
        best = (-math.inf, math.inf)
        best_state = None

        def check(epoch: int) -> dict[str, float]:
            nonlocal best, best_state
            was_fitted, self._fitted = self._fitted, True  # checks predict from the current state
            try:
                acc, nll = self.accuracy(val_x, val_y), self.nll(val_x, val_y)
            finally:
                self._fitted = was_fitted
            history["val_accuracy"].append(acc)
            history["val_nll"].append(nll)
            history["val_iteration"].append(epoch)
            if (acc, -nll) > (best[0], -best[1]):
                best, best_state = (acc, nll), copy.deepcopy(self.state_dict())
            return {"val_accuracy": acc, "val_nll": nll}

        was_training = self.training
        self.train()
        if val_x is not None:
            check(0)
        epoch = 0
        try:
            with reporter:
                for epoch in range(1, max_iter + 1):
                    perm = torch.randperm(n, device=x.device)
                    total = 0.0
                    for idx in _minibatches(perm, batch_size):
                        ce, potential = self.losses(x[idx], y[idx], n)
                        opt.zero_grad(set_to_none=True)
                        # a parameter the forward pass does not use (a spare head) gets a zero
                        # gradient
                        grads = (
                            torch.autograd.grad(ce, hyper, retain_graph=True, allow_unused=True)
                            if hyper
                            else ()
                        )
                        for p, g in zip(hyper, grads, strict=True):
                            p.grad = torch.zeros_like(p) if g is None else g
                        if theta_transform is not None:
                            (self.class_weights.grad,) = torch.autograd.grad(
                                potential, [self.class_weights]
                            )
                        if emb_transform is not None:
                            with torch.no_grad():
                                for p in emb_params:
                                    p.grad.mul_(n)  # gradient of the total cross entropy
                            emb_transform.transform_()
                            with torch.no_grad():
                                for p in emb_params:
                                    p.grad.div_(n)
                        if theta_transform is not None:
                            theta_transform.transform_()
                        opt.step()
                        total += float(ce.detach()) * idx.numel()
                    history["loss"].append(total / n)
                    info = {}
                    if val_x is not None and (epoch % check_every == 0 or epoch == max_iter):
                        info = check(epoch)
                    if reporter.update(epoch, loss=history["loss"][-1], **info):
                        break
            if val_x is not None:
                if history["val_iteration"][-1] != epoch:  # stopped by the callback
                    check(epoch)
                self.load_state_dict(best_state)
        finally:
            self.train(was_training)
        self._fitted = True
        return self

    def _check_input_width(self, x: Tensor, name: str = "x", check_latent: bool = True) -> None:
        """Raise a ``ValueError`` if the feature extractor cannot take rows of ``x`` (tried on
        one row in evaluation mode: BatchNorm in training mode refuses one row, and would fold it
        into its running statistics), or (with ``check_latent``) maps them to another width than
        ``latent_dim``."""
        try:
            self._evaluate(lambda: self.feature_extractor(x[:1]))
        except (RuntimeError, ValueError) as err:
            raise ValueError(
                f"{name} with {x.shape[-1]} features does not fit the feature extractor: {err}"
            ) from err
        if check_latent:
            self._evaluate(lambda: self.embed(x[:1]))


def _minibatches(perm: Tensor, batch_size: int) -> list[Tensor]:
    """Split ``perm`` into chunks of ``batch_size``; with ``batch_size > 1``, a last chunk of one
    row joins the one before it."""
    chunks = list(perm.split(batch_size))
    if batch_size > 1 and len(chunks) > 1 and chunks[-1].numel() == 1:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    return chunks


def _mark_fitted(module: nn.Module, incompatible_keys: object) -> None:
    """``load_state_dict`` post-hook: a model given a state is fitted."""
    module._fitted = True
