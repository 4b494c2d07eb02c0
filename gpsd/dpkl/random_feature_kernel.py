"""Random Fourier / orthogonal random feature approximation of a stationary kernel."""

from __future__ import annotations

import math

import torch
from gpytorch import settings
from gpytorch.constraints import Interval, Positive
from gpytorch.kernels import Kernel
from gpytorch.models.exact_prediction_strategies import LinearPredictionStrategy
from linear_operator.operators import (
    LowRankRootLinearOperator,
    MatmulLinearOperator,
    RootLinearOperator,
)
from torch import Tensor

from gpsd._internal.distances import same_inputs
from gpsd._internal.validation import check_int

__all__ = ["RandomFeatureKernel", "sample_spectral_frequencies"]


def sample_spectral_frequencies(
    num_features: int,
    num_dims: int,
    *,
    nu: float | None = None,
    orthogonal: bool = False,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    r"""Frequencies :math:`\mathbf{v}_1, \dots, \mathbf{v}_R` of a unit-lengthscale kernel.

    * RBF (``nu=None``): :math:`\mathbf{v}_r \sim \mathcal{N}(0, \mathbf{I}_d)`, the spectral
      density of :math:`\exp(-\lVert \mathbf{z} - \mathbf{z}' \rVert^2 / 2)`.
    * Matérn-:math:`\nu`: the spectral density is a multivariate Student-t with :math:`2\nu`
      degrees of freedom, :math:`\mathbf{v}_r = \mathbf{g}_r \sqrt{2\nu / u_r}` with
      :math:`\mathbf{g}_r \sim \mathcal{N}(0, \mathbf{I}_d)`, :math:`u_r \sim \chi^2_{2\nu}`.
    * ``orthogonal=True`` (Yu et al., 2016): blocks of :math:`d` rows
      :math:`\mathbf{S}\mathbf{Q}`, :math:`\mathbf{Q}` a Haar-random orthogonal matrix (QR of a
      Gaussian matrix with the signs of :math:`\operatorname{diag}\mathbf{R}` fixed) and
      :math:`\mathbf{S}` a diagonal of independent :math:`\chi_d` norms, so that every row is
      still :math:`\mathcal{N}(0, \mathbf{I}_d)` but the rows of a block are orthogonal; the
      last block is truncated to :math:`R` rows in total.

    ``nu`` must be a finite number :math:`> 0` (any, not only GPyTorch's three values).
    Returns a tensor of shape ``(num_features, num_dims)`` on ``device`` (default: the
    generator's device, or the CPU). A ``generator`` draws on its own device and the result is
    moved, so a CPU generator seeds a CUDA model (the same frequencies as on the CPU).
    """
    num_features = check_int(num_features, "num_features")
    num_dims = check_int(num_dims, "num_dims")
    if nu is not None and not (
        isinstance(nu, (int, float)) and not isinstance(nu, bool) and math.isfinite(nu) and nu > 0
    ):
        raise ValueError(f"nu must be None (RBF) or a finite Matérn smoothness > 0, got {nu!r}")
    dtype = dtype or torch.get_default_dtype()
    # draw where the generator lives (torch refuses a CPU generator for CUDA draws), then move
    kw = {"dtype": dtype, "device": generator.device if generator is not None else device}
    if orthogonal:
        num_blocks = math.ceil(num_features / num_dims)
        g = torch.randn(num_blocks, num_dims, num_dims, generator=generator, **kw)
        q, r = torch.linalg.qr(g)  # batched over the blocks
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
        norms = torch.randn(num_blocks, num_dims, num_dims, generator=generator, **kw).norm(dim=-1)
        blocks = norms.unsqueeze(-1) * q.mT  # rows: chi_d-scaled orthonormal directions
        freq = blocks.reshape(num_blocks * num_dims, num_dims)[:num_features]
    else:
        freq = torch.randn(num_features, num_dims, generator=generator, **kw)
    if nu is not None:
        freq = freq * torch.sqrt(2.0 * nu / _chi_square(2.0 * nu, num_features, generator, kw))
    return freq if device is None else freq.to(device)


def _chi_square(dof: float, num: int, generator: torch.Generator | None, kw: dict) -> Tensor:
    r""":math:`\chi^2_{\nu}` draws of shape ``(num, 1)``, all from ``generator`` when given.

    An integer number of degrees of freedom (every Matérn kernel GPyTorch has) is a sum of squared
    normals; any other comes from ``torch.distributions.Gamma``, which takes no generator, so it
    runs under a forked global RNG seeded from ``generator``.
    """
    if float(dof).is_integer():
        return torch.randn(num, int(dof), generator=generator, **kw).pow(2).sum(-1, keepdim=True)
    conc = torch.full((num, 1), 0.5 * dof, dtype=kw["dtype"])
    if generator is None:
        draw = torch.distributions.Gamma(conc, torch.ones_like(conc)).sample()
    else:
        seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        with torch.random.fork_rng(devices=[]):  # Gamma samples on the CPU: fork only its RNG
            torch.default_generator.manual_seed(seed)  # torch.manual_seed would reseed CUDA's too
            draw = torch.distributions.Gamma(conc, torch.ones_like(conc)).sample()
    return (2.0 * draw).to(kw["device"])


class RandomFeatureKernel(Kernel):
    r"""A stationary kernel approximated by :math:`R` random Fourier features (Rahimi & Recht).

    .. math::

        k(\mathbf{z}, \mathbf{z}') \approx \mathbf{f}(\mathbf{z})^\top \mathbf{f}(\mathbf{z}'),
        \qquad
        \mathbf{f}(\mathbf{z}) = \sqrt{\frac{s}{R}}
            \big[\cos(\mathbf{V}\boldsymbol{\Lambda}^{-1}\mathbf{z}),\;
                 \sin(\mathbf{V}\boldsymbol{\Lambda}^{-1}\mathbf{z})\big] \in \mathbb{R}^{2R},

    which is unbiased for :math:`s \cdot k_{\text{base}}` with lengthscales
    :math:`\boldsymbol{\Lambda}` (learnable, ARD if ``ard_num_dims`` is given) and outputscale
    :math:`s` (learnable). The base kernel is the RBF ``exp(-r^2/2)`` (``nu=None``) or a Matérn
    kernel with ``nu`` in {0.5, 1.5, 2.5} (GPyTorch's conventions). The unit frequencies
    :math:`\mathbf{V}` (see :func:`sample_spectral_frequencies`) are a buffer, redrawn by
    :meth:`resample`.

    ``K(Z, Z)`` is returned as a :class:`~linear_operator.operators.LowRankRootLinearOperator`
    when :math:`2R < n` or :math:`n` exceeds ``gpytorch.settings.max_cholesky_size`` (else as a
    :class:`~linear_operator.operators.RootLinearOperator`, factorised densely), so that adding
    the likelihood noise gives a
    :class:`~linear_operator.operators.LowRankRootAddedDiagLinearOperator`, whose solves and log
    determinant use the Woodbury identity and the matrix determinant lemma (O(n R^2));
    predictions use GPyTorch's :class:`~gpytorch.models.exact_prediction_strategies.LinearPredictionStrategy`.

    :param num_features: :math:`R \ge 1` (the feature vector has :math:`2R` entries).
    :param num_dims: input dimension :math:`d`.
    :param nu: ``None`` for RBF, else the Matérn smoothness.
    :param orthogonal: orthogonal random features (Yu et al., 2016) instead of i.i.d. ones.
    """

    has_lengthscale = True

    def __init__(
        self,
        num_features: int,
        num_dims: int,
        *,
        nu: float | None = None,
        orthogonal: bool = False,
        outputscale_constraint: Interval | None = None,
        **kwargs,
    ) -> None:
        num_features = check_int(num_features, "num_features (R)")
        num_dims = check_int(num_dims, "num_dims")
        if nu is not None and nu not in (0.5, 1.5, 2.5):
            raise ValueError(f"nu must be None (RBF) or one of 0.5, 1.5, 2.5, got {nu}")
        ard = kwargs.get("ard_num_dims")
        if ard is not None and ard != num_dims:
            raise ValueError(f"ard_num_dims must equal num_dims={num_dims}, got {ard}")
        super().__init__(**kwargs)
        self.num_features = num_features
        self.num_dims = num_dims
        self.nu = nu
        self.orthogonal = orthogonal
        self.register_parameter(
            "raw_outputscale", torch.nn.Parameter(torch.zeros(self.batch_shape))
        )
        self.register_constraint("raw_outputscale", outputscale_constraint or Positive())
        self.outputscale = 1.0
        self.register_buffer(
            "base_frequencies",
            sample_spectral_frequencies(
                num_features,
                num_dims,
                nu=nu,
                orthogonal=orthogonal,
                dtype=self.raw_lengthscale.dtype,
            ),
        )

    @property
    def outputscale(self) -> Tensor:
        return self.raw_outputscale_constraint.transform(self.raw_outputscale)

    @outputscale.setter
    def outputscale(self, value: float | Tensor) -> None:
        if not torch.is_tensor(value):
            # read in the parameter's dtype: torch.as_tensor(0.7) would be float32, and 0.7
            # would become 0.699999988079071 in a float64 kernel
            raw = self.raw_outputscale
            value = torch.as_tensor(value, dtype=raw.dtype, device=raw.device)
        self.initialize(raw_outputscale=self.raw_outputscale_constraint.inverse_transform(value))

    def resample(self, generator: torch.Generator | None = None) -> None:
        """Draw new unit frequencies in place.

        An :class:`~gpytorch.models.ExactGP` in evaluation mode keeps the training features
        it cached at its first prediction; after resampling, call ``model.train()`` (then
        ``model.eval()``) so that its next prediction uses the new frequencies. (The ``predict``
        of gpsd's DPKL regressors notices the change by itself.)
        """
        self.base_frequencies.copy_(
            sample_spectral_frequencies(
                self.num_features,
                self.num_dims,
                nu=self.nu,
                orthogonal=self.orthogonal,
                generator=generator,
                dtype=self.base_frequencies.dtype,
                device=self.base_frequencies.device,
            )
        )

    def featurize(self, z: Tensor) -> Tensor:
        r"""The feature map :math:`\mathbf{f}(\mathbf{z})`: ``(..., n, d) -> (..., n, 2R)``."""
        if z.shape[-1] != self.num_dims:
            raise ValueError(
                f"inputs must have num_dims={self.num_dims} features in their last dimension, "
                f"got shape {tuple(z.shape)}"
            )
        proj = (z / self.lengthscale) @ self.base_frequencies.mT  # shape: (..., n, R)
        scale = (self.outputscale / self.num_features).sqrt()
        scale = scale.view(*scale.shape, 1, 1)
        return torch.cat([proj.cos(), proj.sin()], -1) * scale

    @staticmethod
    def features_to_operator(phi1: Tensor, phi2: Tensor | None, diag: bool):
        """``phi1 phi2^T`` as a (low-rank) operator; ``phi2=None`` means the symmetric case."""
        if diag:
            return (phi1 * (phi1 if phi2 is None else phi2)).sum(-1)
        if phi2 is None:
            num_rows, num_cols = phi1.shape[-2], phi1.shape[-1]  # phi1: (..., n, 2R)
            # Above max_cholesky_size GPyTorch solves a RootLinearOperator plus noise by conjugate
            # gradients and a stochastic (Lanczos) log determinant: a random, inexact marginal
            # likelihood. The low-rank form is solved exactly by Woodbury at any size.
            if num_cols < num_rows or num_rows > settings.max_cholesky_size.value():
                return LowRankRootLinearOperator(phi1)
            return RootLinearOperator(phi1)
        return MatmulLinearOperator(phi1, phi2.mT)

    def forward(
        self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params
    ):
        if last_dim_is_batch:
            raise ValueError("last_dim_is_batch is not supported by RandomFeatureKernel")
        phi1 = self.featurize(x1)
        if same_inputs(x1, x2):
            return self.features_to_operator(phi1, None, diag)
        return self.features_to_operator(phi1, self.featurize(x2), diag)

    def prediction_strategy(self, train_inputs, train_prior_dist, train_labels, likelihood):
        return LinearPredictionStrategy(train_inputs, train_prior_dist, train_labels, likelihood)
