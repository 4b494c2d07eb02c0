"""SSDPKL: DPKL with the posterior-variance regulariser on unlabelled data (§3.3, eq. 14)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator import to_linear_operator
from torch import Tensor, nn

from gpsd._internal.validation import check_int, check_positive_float
from gpsd.dpkl._regressor_base import check_inputs
from gpsd.dpkl.dpkl_regressor import DPKLRegressor

__all__ = ["SSDPKLRegressor"]


class SSDPKLRegressor(DPKLRegressor):
    r"""Semi-supervised DPKL (Mallick et al., §3.3, eq. 14; the regulariser of Jean et al., 2018).

    The training loss is

    .. math::

        \frac{1}{n_l}\hat{L} + \frac{\alpha}{|B|}\sum_{\mathbf{x}\in B}\sigma^2(\mathbf{x}),
        \qquad
        \sigma^2(\mathbf{x}) = \hat K(\mathbf{x}, \mathbf{x})
            - \mathbf{k}_\star^\top(\hat{\mathbf K} + \sigma_\eta^2\mathbf I)^{-1}\mathbf{k}_\star,

    where :math:`B` is a minibatch of ``unlabelled_batch_size`` rows of the unlabelled inputs
    drawn afresh every step (all of them if fewer) and :math:`\sigma^2` is the latent posterior
    variance (:meth:`~gpsd.dpkl.DPKLRegressor.latent_posterior_variance`) with the true prior
    variance :math:`\hat K(\mathbf{x}, \mathbf{x})` of the kernel: the exact expected kernel's
    for ``embedding_kernel="exact"``, :math:`\lVert\bar{\boldsymbol\phi}(\mathbf{x})\rVert^2` for
    ``embedding_kernel="rff"`` (then, by Prop. 2, :math:`\sigma^2` is the squared RKHS distance of the
    embedding of :math:`p(\mathbf Z\mid\mathbf x)` from the span of the labelled embeddings).
    Both terms come from one pass of the feature extractor over the labelled rows and :math:`B`
    together: in training mode (:meth:`fit`) each row's embeddings are drawn once (one dropout
    draw, used in both terms) and BatchNorm normalises all the rows as one batch, updating its
    running statistics once per step. All other arguments are those of :class:`~gpsd.dpkl.DPKLRegressor`,
    except that ``input_kernel`` defaults to ``None`` (the paper's kernel).

    The regulariser's gradient reaches every parameter that :math:`\sigma^2` depends on: the
    particles, the lengthscale, and also the outputscale (which scales
    :math:`\sigma^2`) and the noise :math:`\sigma_\eta^2`, as in Jean et al.'s SSDKL. A large
    :math:`\alpha` therefore pulls the outputscale and the noise down (the posterior variance
    grows with both) as well as moving the embeddings; freeze them (``requires_grad_(False)``)
    to regularise the embeddings alone.

    :param train_x: ``(n, D)`` labelled training inputs, or ``(n,)`` for one input feature.
    :param train_y: ``(n,)`` training targets (standardise them).
    :param feature_extractor: as in :class:`~gpsd.dpkl.DPKLRegressor`.
    :param unlabelled_x: ``(n_u, D)`` unlabelled inputs (``(n_u,)`` for one feature).
    :param alpha: the regularisation weight :math:`\alpha \ge 0`.
    :param unlabelled_batch_size: minibatch size for the regulariser.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        feature_extractor: nn.Module | Callable[[], nn.Module],
        *,
        unlabelled_x: Tensor,
        alpha: float = 1.0,
        unlabelled_batch_size: int = 256,
        **kwargs,
    ) -> None:
        train_x = check_inputs(train_x, "train_x")
        unlabelled_x = check_inputs(unlabelled_x, "unlabelled_x", train_x.shape[-1], like=train_x)
        unlabelled_batch_size = check_int(unlabelled_batch_size, "unlabelled_batch_size")
        kwargs.setdefault("input_kernel", None)  # the paper's kernel unless one is asked for
        super().__init__(train_x, train_y, feature_extractor, **kwargs)
        # data, as ExactGP's train_inputs: follows .to() but stays out of state_dict()
        self.register_buffer("unlabelled_x", unlabelled_x, persistent=False)
        self.alpha = alpha
        self.unlabelled_batch_size = unlabelled_batch_size

    @property
    def alpha(self) -> float:
        r"""The regularisation weight :math:`\alpha \ge 0`."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = check_positive_float(value, "alpha", allow_zero=True)

    def _unlabelled_batch(self) -> Tensor:
        """A random minibatch of ``unlabelled_batch_size`` unlabelled rows (all if fewer)."""
        n_u = self.unlabelled_x.shape[0]
        if n_u <= self.unlabelled_batch_size:
            return self.unlabelled_x
        idx = torch.randperm(n_u, device=self.unlabelled_x.device)[: self.unlabelled_batch_size]
        return self.unlabelled_x[idx]

    def regulariser(self, x: Tensor | None = None) -> Tensor:
        r"""Mean latent posterior variance over ``x`` (default: a random unlabelled minibatch),
        in the model's current mode (see :meth:`latent_posterior_variance`)."""
        return self.latent_posterior_variance(self._unlabelled_batch() if x is None else x).mean()

    def training_loss(self) -> Tensor:
        r"""The loss above, from one pass of the feature extractor over the labelled rows and an
        unlabelled minibatch (with :math:`\alpha = 0`, over the labelled rows alone), in the
        model's current mode (see :meth:`~gpsd.dpkl.DPKLRegressor.training_loss`)."""
        if self.alpha == 0:
            return super().training_loss()
        train_x = self.train_inputs[0]
        n = train_x.shape[0]
        features = self.covar_module.features(torch.cat([train_x, self._unlabelled_batch()]))
        # a linear operator, as a kernel's output: no Cholesky factor of the noise-free matrix
        covariance = to_linear_operator(self.covar_module.feature_covariance(features[..., :n, :]))
        prior = MultivariateNormal(self.mean_module(train_x), covariance)
        regulariser = self._posterior_variance(features, n).mean()
        return self._negative_mll(prior) + self.alpha * regulariser
