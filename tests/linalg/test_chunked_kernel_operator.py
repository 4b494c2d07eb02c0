"""Tests of ChunkedKernelOperator: products and diagonals against the dense kernel
matrix, the kernel rows it keeps, the dropping of negligible entries, and its argument checks."""

import gpytorch
import pytest
import torch
from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel

from gpsd._internal.negligible import drop_negligible, kernel_matrix
from gpsd.linalg import (
    ChunkedKernelOperator,
)

DTYPE = torch.float64


def counted_kernel(lengthscale=0.7, batch_shape=()):
    """An RBF kernel that records the number of rows of every evaluation of a block (not of
    the diagonals, ``diag=True``, with which the operator fixes the entries k(x_i, x_i))."""
    kernel = gpytorch.kernels.RBFKernel(batch_shape=torch.Size(batch_shape)).to(DTYPE)
    kernel.lengthscale = torch.tensor(lengthscale, dtype=DTYPE)  # a float would round to float32
    rows = []
    forward = kernel.forward

    def counting(x1, x2, **kwargs):
        if not kwargs.get("diag", False):
            rows.append(x1.shape[-2])
        return forward(x1, x2, **kwargs)

    kernel.forward = counting
    return kernel, rows


def reference(x, lengthscale):
    """exp(-|x - x'|^2 / (2 l^2)) by cdist: independent of GPyTorch's kernel code."""
    return torch.exp(-0.5 * torch.cdist(x, x).square() / lengthscale**2)


def test_a_budget_for_all_rows_evaluates_the_kernel_once():
    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.rand(100, 2, generator=gen, dtype=DTYPE)
    rhs = torch.randn(100, 3, generator=gen, dtype=DTYPE)
    kernel, rows = counted_kernel()
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=32, cache_bytes=100 * 100 * 8)
    with torch.no_grad():
        first, second = op @ rhs, op @ rhs
    expected = reference(x, 0.7) @ rhs
    torch.testing.assert_close(first, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second, expected, rtol=1e-12, atol=1e-12)
    assert rows == [32, 32, 32, 4]  # the first product only
    assert op.kept_bytes == 100 * 100 * 8


def test_a_partial_budget_keeps_the_leading_chunks_that_fit():
    gen = torch.Generator().manual_seed(1)
    x = 3 * torch.rand(100, 2, generator=gen, dtype=DTYPE)
    rhs = torch.randn(100, 2, generator=gen, dtype=DTYPE)
    kernel, rows = counted_kernel()
    # room for one and a half chunks of 32 x 100 float64 entries: one is kept
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=32, cache_bytes=48 * 100 * 8)
    with torch.no_grad():
        op @ rhs
        rows.clear()
        got = op @ rhs
    torch.testing.assert_close(got, reference(x, 0.7) @ rhs, rtol=1e-12, atol=1e-12)
    assert rows == [32, 32, 4]  # chunks 2 to 4 are evaluated again; chunk 1 is read
    assert op.kept_bytes == 32 * 100 * 8


def test_rows_are_kept_from_the_product_after_keep_after():
    x = torch.rand(70, 3, dtype=DTYPE)
    kernel, rows = counted_kernel()
    op = ChunkedKernelOperator(
        x, covar_module=kernel, chunk_size=32, cache_bytes=10**6, keep_after=2
    )
    with torch.no_grad():
        for _ in range(5):
            op @ torch.ones(70, 1, dtype=DTYPE)
    assert rows == [32, 32, 6] * 3  # products 1 and 2 afresh, 3 kept, 4 and 5 read
    with pytest.raises(ValueError, match="keep_after must be a non-negative integer"):
        ChunkedKernelOperator(x, covar_module=kernel, keep_after=-1)


def test_without_a_budget_every_product_evaluates_every_chunk():
    x = torch.rand(70, 3, dtype=DTYPE)
    kernel, rows = counted_kernel()
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=32)
    with torch.no_grad():
        op @ torch.ones(70, 1, dtype=DTYPE)
        op @ torch.ones(70, 1, dtype=DTYPE)
    assert rows == [32, 32, 6] * 2
    assert op.kept_bytes == 0


def test_kept_rows_are_dropped_when_the_kernel_or_the_inputs_change():
    gen = torch.Generator().manual_seed(2)
    x = 3 * torch.rand(60, 2, generator=gen, dtype=DTYPE)
    rhs = torch.randn(60, 2, generator=gen, dtype=DTYPE)
    kernel, _ = counted_kernel(lengthscale=0.7)
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=16, cache_bytes=10**6)
    with torch.no_grad():
        op @ rhs
        kernel.lengthscale = torch.tensor(0.3, dtype=DTYPE)  # new hyperparameters
        after_kernel = op @ rhs
        x.mul_(0.5)  # inputs written in place
        after_inputs = op @ rhs
    torch.testing.assert_close(after_kernel, reference(2 * x, 0.3) @ rhs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after_inputs, reference(x, 0.3) @ rhs, rtol=1e-12, atol=1e-12)


def test_kept_rows_of_a_batch_of_kernels():
    gen = torch.Generator().manual_seed(3)
    x = 3 * torch.rand(2, 50, 2, generator=gen, dtype=DTYPE)
    rhs = torch.randn(2, 50, 4, generator=gen, dtype=DTYPE)
    kernel, rows = counted_kernel(lengthscale=0.7, batch_shape=torch.Size([2]))
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=20, cache_bytes=10**6)
    with torch.no_grad():
        op @ rhs
        got = op @ rhs
    torch.testing.assert_close(got, reference(x, 0.7) @ rhs, rtol=1e-12, atol=1e-12)
    assert rows == [20, 20, 10]
    assert op.kept_bytes == 2 * 50 * 50 * 8


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="cache_bytes must be a non-negative integer"):
        ChunkedKernelOperator(
            torch.rand(5, 1), covar_module=gpytorch.kernels.RBFKernel(), cache_bytes=-1
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_negligible_entries_are_zeroed_and_no_subnormal_is_left(dtype):
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    x = torch.linspace(0, 60, 400, dtype=dtype).unsqueeze(-1)
    k = torch.exp(-0.5 * torch.cdist(x, x).square())  # decays through the subnormal range
    subnormal = (k != 0) & (k.abs() < tiny)
    assert bool(subnormal.any())  # the test case has some to remove
    got = drop_negligible(k)
    small = k.abs() <= eps**2 * k.abs().max()
    assert bool((got[small] == 0).all())
    assert torch.equal(got[~small], k[~small])  # every other entry is untouched
    assert not bool(((got != 0) & (got.abs() < tiny)).any())
    # a product changes by far less than its rounding: compare in float64 against the original
    rhs = torch.randn(400, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    change = (got.double() - k.double()) @ rhs
    assert float(change.abs().max()) <= 400 * eps**2 * float(rhs.abs().max())


@pytest.mark.parametrize("inplace", [False, True])
def test_dropping_is_per_matrix_of_a_batch_and_handles_negative_entries(inplace):
    k = torch.tensor(
        [
            [[1.0, 1e-40, 2e-31], [0.5, 1e-33, 0.0]],  # scale 1: 1e-40 and 1e-33 go
            [[1e-30, 1e-60, 3e-30], [1e-30, 1e-68, 0.0]],  # scale 3e-30: only 1e-68 goes
        ],
        dtype=DTYPE,
    )
    signed = torch.tensor([[-2.0, 1e-40], [-1e-40, 1e-20]], dtype=DTYPE)
    expected_k = k.clone()
    expected_k[0, 0, 1] = expected_k[0, 1, 1] = expected_k[1, 1, 1] = 0.0
    expected_signed = torch.tensor([[-2.0, 0.0], [0.0, 1e-20]], dtype=DTYPE)
    for matrix, expected in ((k, expected_k), (signed, expected_signed)):
        got = drop_negligible(matrix, inplace=inplace)
        assert torch.equal(got, expected)
        assert (got is matrix) == inplace  # overwritten, or a new tensor


def test_a_matrix_with_nothing_to_drop_is_returned_as_it_is():
    k = torch.rand(30, 20, dtype=DTYPE) + 1e-3
    assert drop_negligible(k) is k
    zeros = torch.zeros(1, dtype=DTYPE).expand(4, 4)  # an expanded view cannot be overwritten
    assert torch.equal(drop_negligible(zeros, inplace=True), zeros)


def test_dropping_keeps_non_finite_entries_and_ignores_non_floats():
    k = torch.tensor([[1.0, 1e-40], [float("nan"), float("inf")]], dtype=DTYPE)
    got = drop_negligible(k)
    assert got[0, 1] == 1e-40  # an infinite entry does not make the others negligible
    assert torch.isnan(got[1, 0]) and torch.isinf(got[1, 1])
    integers = torch.arange(4).reshape(2, 2)
    assert drop_negligible(integers) is integers


def test_dropping_passes_gradients_to_the_kept_entries():
    k = torch.tensor([[2.0, 1e-300], [1e-300, 3.0]], dtype=DTYPE, requires_grad=True)
    drop_negligible(k).sum().backward()
    torch.testing.assert_close(k.grad, torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=DTYPE))


def test_kernel_matrix_is_the_dense_kernel_without_negligible_entries_and_keeps_gradients():
    gen = torch.Generator().manual_seed(5)
    x1 = 8 * torch.rand(60, 1, generator=gen, dtype=DTYPE)
    x2 = 8 * torch.rand(25, 1, generator=gen, dtype=DTYPE)
    kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
    kernel.lengthscale = torch.tensor(0.3, dtype=DTYPE)
    ls = torch.tensor(0.3, dtype=DTYPE, requires_grad=True)
    eps = torch.finfo(DTYPE).eps
    for a, b in ((x1, None), (x1, x2)):
        other = a if b is None else b
        expected = torch.exp(-0.5 * torch.cdist(a, other).square() / ls**2)
        negligible = expected.detach() <= eps**2 * expected.detach().max()
        assert bool(negligible.any())  # the case has entries to drop
        got = kernel_matrix(kernel, a, b)
        assert type(got) is torch.Tensor  # evaluated, not a lazy kernel tensor
        assert bool((got[negligible] == 0).all())
        torch.testing.assert_close(got[~negligible], expected.detach()[~negligible])
        # the lengthscale's gradient agrees with autograd through the cdist formula
        (grad,) = torch.autograd.grad(got.sum(), kernel.raw_lengthscale)
        (ref,) = torch.autograd.grad(expected.sum(), ls)
        chain = torch.sigmoid(kernel.raw_lengthscale.detach())  # softplus' derivative
        torch.testing.assert_close(grad.squeeze(), ref * chain.squeeze())


def test_a_batch_of_kernels_on_shared_inputs():
    """A kernel with a batch shape on unbatched inputs: the product takes the kernel's batch."""
    gen = torch.Generator().manual_seed(4)
    x = 3 * torch.rand(45, 2, generator=gen, dtype=DTYPE)
    rhs = torch.randn(45, 3, generator=gen, dtype=DTYPE)
    kernel = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).to(DTYPE)
    kernel.lengthscale = torch.tensor([[[0.4]], [[1.1]]], dtype=DTYPE)
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=20)
    with torch.no_grad():
        got = op @ rhs
    expected = torch.stack([reference(x, 0.4) @ rhs, reference(x, 1.1) @ rhs])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def _kernels(dtype: torch.dtype):
    torch.manual_seed(0)
    batched = ScaleKernel(RBFKernel(batch_shape=torch.Size([2])), batch_shape=torch.Size([2]))
    batched.outputscale = torch.tensor([0.7, 1.9])
    return {
        "matern12": MaternKernel(nu=0.5),
        "scaled_matern12_ard": ScaleKernel(MaternKernel(nu=0.5, ard_num_dims=3)),
        "sum": ScaleKernel(RBFKernel()) + ScaleKernel(MaternKernel(nu=0.5)),
        "batched": batched,
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["matern12", "scaled_matern12_ard", "sum", "batched"])
@pytest.mark.parametrize("cache_bytes", [0, 10**8])
def test_chunked_operator_matches_dense_kernel(dtype, name, cache_bytes):
    # Row chunks that are not the whole input (chunk_size 5 of N = 37, last chunk 2 rows)
    # evaluate k(x_i, x_i) from a rounding-size distance, which makes a Matern-1/2 diagonal
    # 1 - 4.2e-8 in float64 (1 - 1.4e-3 in float32) where kernel(x) and the exact value give 1,
    # and K @ B off by 2e-8 (float32: 2e-3) unless the operator takes the diagonal from
    # kernel(x_I, diag=True). Both must agree to rounding.
    kernel = _kernels(dtype)[name].to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 3, generator=gen, dtype=torch.float64).to(dtype)
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=5, cache_bytes=cache_bytes)
    with torch.no_grad():
        dense = kernel(x).to_dense()  # shape: (*b, 37, 37)
        rhs = torch.randn(*dense.shape[:-1], 4, generator=gen, dtype=torch.float64).to(dtype)
        rtol = 1e-12 if dtype == torch.float64 else 2e-6
        scale = float(dense.abs().max())
        for _ in range(2):  # the second product reads the kept rows where cache_bytes > 0
            product = op @ rhs
            ref = (dense.double() @ rhs.double()).to(dtype)
            assert float((product - ref).abs().max()) <= rtol * scale * rhs.abs().sum(-2).max()
        chunked = op.to_dense()
        exact_diag = kernel(x, diag=True)  # shape: (*b, 37)
        assert float((chunked.diagonal(dim1=-2, dim2=-1) - exact_diag).abs().max()) <= (
            rtol * scale
        )
        assert float((chunked - dense).abs().max()) <= rtol * scale * 10


def test_diagonal_of_a_batched_kernel_on_as_many_points_as_batch_entries():
    # A ScaleKernel with batch shape (2,) on 2 unbatched points: GPyTorch's diag=True gives the
    # output scales, shape (2,); taken as the diagonal, they would make the trace (what
    # KernelSpectrum.from_lanczos reads for its complement bound) 2.6 instead of (1.4, 3.8).
    kernel = ScaleKernel(RBFKernel(batch_shape=torch.Size([2])), batch_shape=torch.Size([2]))
    kernel = kernel.to(torch.float64)
    kernel.outputscale = torch.tensor([0.7, 1.9], dtype=torch.float64)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    op = ChunkedKernelOperator(x, covar_module=kernel)
    with torch.no_grad():
        diagonal = op.diagonal(dim1=-2, dim2=-1)
    expected = torch.tensor([[0.7, 0.7], [1.9, 1.9]], dtype=torch.float64)  # outputscale * 1
    assert diagonal.shape == (2, 2)
    torch.testing.assert_close(diagonal, expected)


def test_chunked_kernel_operator_products_and_diagonal():
    import gpytorch

    from gpsd.linalg import ChunkedKernelOperator

    x = torch.rand(2, 130, 3, dtype=DTYPE)
    kernel = gpytorch.kernels.MaternKernel(batch_shape=torch.Size([2])).to(DTYPE)
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=32)
    dense = kernel(x).to_dense().detach()
    rhs = torch.randn(2, 130, 4, dtype=DTYPE)
    assert op.shape == (2, 130, 130)
    torch.testing.assert_close(op @ rhs, dense @ rhs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.diagonal(dim1=-2, dim2=-1), dense.diagonal(dim1=-2, dim2=-1))
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedKernelOperator(x, covar_module=kernel, chunk_size=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_refused_at_construction(bad):
    x = torch.rand(10, 2, dtype=DTYPE)
    x[3, 1] = bad
    with pytest.raises(ValueError, match="x must be finite, but it holds 1 NaN or infinite"):
        ChunkedKernelOperator(x, covar_module=gpytorch.kernels.RBFKernel().to(DTYPE))


def test_inputs_that_are_not_a_floating_point_matrix_are_refused():
    kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor of inputs"):
        ChunkedKernelOperator(torch.ones(10, 2, dtype=torch.int64), covar_module=kernel)
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor of inputs"):
        ChunkedKernelOperator([[0.0, 1.0]], covar_module=kernel)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_non_finite_right_hand_side_is_refused_rather_than_multiplied_into_nan(bad):
    x = torch.rand(12, 2, dtype=DTYPE)
    operator = ChunkedKernelOperator(x, covar_module=gpytorch.kernels.RBFKernel().to(DTYPE))
    rhs = torch.ones(12, 3, dtype=DTYPE)
    rhs[5, 2] = bad
    with pytest.raises(ValueError, match="rhs, the right-hand side of a product .* holds 1 NaN"):
        operator @ rhs
    # a finite right-hand side still multiplies as the dense matrix does
    rhs[5, 2] = 0.0
    dense = gpytorch.kernels.RBFKernel().to(DTYPE)(x).to_dense()
    torch.testing.assert_close(operator @ rhs, dense @ rhs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cache_bytes", [0, 10**7])
def test_a_block_of_rows_multiplies_as_those_rows_of_the_dense_kernel(cache_bytes):
    x = torch.rand(2, 70, 3, dtype=DTYPE)
    kernel, rows = counted_kernel(lengthscale=0.4, batch_shape=(2,))
    op = ChunkedKernelOperator(
        x, covar_module=kernel, chunk_size=16, cache_bytes=cache_bytes, rows=slice(23, 61)
    )
    dense = torch.stack([reference(x[i], 0.4) for i in range(2)])  # shape: (2, 70, 70)
    rhs = torch.randn(2, 70, 4, dtype=DTYPE)
    assert op.shape == (2, 38, 70)
    for _ in range(2):
        torch.testing.assert_close(op @ rhs, dense[:, 23:61] @ rhs, rtol=1e-12, atol=1e-12)
    # chunks of 16 rows from row 23 on, the last one cut at row 61; kept rows are not evaluated
    assert rows[:3] == [16, 16, 6]
    assert len(rows) == (3 if cache_bytes else 6)


def test_an_empty_block_of_rows_gives_an_empty_product():
    x = torch.rand(9, 2, dtype=DTYPE)
    op = ChunkedKernelOperator(x, covar_module=RBFKernel().to(DTYPE), rows=slice(9, 9))
    assert (op @ torch.ones(9, 2, dtype=DTYPE)).shape == (0, 2)


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        (slice(3, 2), ValueError),
        (slice(-1, 4), ValueError),
        (slice(0, 11), ValueError),
        (slice(0, 6, 2), ValueError),
        ((0, 4), TypeError),
    ],
)
def test_rows_outside_the_matrix_or_with_a_step_are_refused(rows, error):
    x = torch.rand(10, 2, dtype=DTYPE)
    with pytest.raises(error, match="rows must be a slice"):
        ChunkedKernelOperator(x, covar_module=RBFKernel().to(DTYPE), rows=rows)


def test_a_block_of_rows_has_no_transpose_nor_diagonal():
    x = torch.rand(10, 2, dtype=DTYPE)
    op = ChunkedKernelOperator(x, covar_module=RBFKernel().to(DTYPE), rows=slice(0, 4))
    with pytest.raises(ValueError, match="has no diagonal"):
        op._diagonal()
    with pytest.raises(ValueError, match="has no transpose"):
        op._transpose_nonbatch()
    whole = ChunkedKernelOperator(x, covar_module=RBFKernel().to(DTYPE), rows=slice(0, 10))
    assert whole._diagonal().shape == (10,)


@pytest.mark.parametrize("cache_bytes", [0, 10**7])
@pytest.mark.parametrize("offset", [0.0, 1000.0], ids=["origin", "far"])
def test_scaled_rbf_rows_are_multiplied_without_gpytorchs_forward(cache_bytes, offset, monkeypatch):
    """A ScaleKernel(RBFKernel()) has its rows evaluated from augmented inputs in one matrix
    product (``gpsd._internal.stationary_kernel``), not by GPyTorch's ``forward``, and its
    products equal those of the kernel formula, also far from the origin, where the expansion of
    the squared distance needs the inputs centred."""
    gen = torch.Generator().manual_seed(1)
    x = offset + 5 * torch.rand(90, 2, generator=gen, dtype=DTYPE)
    rhs = torch.randn(90, 4, generator=gen, dtype=DTYPE)
    kernel = ScaleKernel(RBFKernel()).to(DTYPE)
    kernel.base_kernel.lengthscale = torch.tensor(0.6, dtype=DTYPE)
    kernel.outputscale = torch.tensor(2.5, dtype=DTYPE)
    z = x / 0.6  # the differences themselves: no expansion in the reference
    exact = 2.5 * torch.exp(-0.5 * (z.unsqueeze(-2) - z.unsqueeze(-3)).square().sum(-1))
    forward = RBFKernel.forward

    def refuse(self, x1, x2, diag=False, **kwargs):
        if not diag:  # the diagonal k(x_i, x_i) is GPyTorch's, as the dense kernel(x) has it
            raise AssertionError("GPyTorch's RBF forward evaluated a block of rows")
        return forward(self, x1, x2, diag=diag, **kwargs)

    monkeypatch.setattr(RBFKernel, "forward", refuse)
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=32, cache_bytes=cache_bytes)
    rows = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=16, rows=slice(20, 70))
    with torch.no_grad():
        with pytest.raises(AssertionError, match="forward evaluated"):  # the patch is live
            kernel(x[:3], x).to_dense()
        products = [op @ rhs for _ in range(2)]
        block_of_rows = rows @ rhs
    for product in products:
        torch.testing.assert_close(product, exact @ rhs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block_of_rows, exact[20:70] @ rhs, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ gradients
def gradient_problem(n=60, dtype=DTYPE, kernel="rbf", seed=0):
    """Inputs, targets and a kernel whose hyperparameters require gradients."""
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.rand(n, 2, generator=gen, dtype=dtype)
    y = torch.sin(2 * x).sum(-1) + 0.1 * torch.randn(n, generator=gen, dtype=dtype)
    base = RBFKernel() if kernel == "rbf" else MaternKernel(nu=1.5, ard_num_dims=2)
    covar = ScaleKernel(base).to(dtype)
    covar.base_kernel.lengthscale = 0.6
    covar.outputscale = 1.4
    return x, y, covar


def dense_log_likelihood(covar, x, y, noise):
    """log N(y; 0, K + noise I) by Cholesky of the matrix from cdist-free GPyTorch-independent
    pieces: the kernel's dense evaluation, torch.distributions."""
    K = covar(x, x).to_dense()
    eye = torch.eye(x.shape[-2], dtype=x.dtype)
    return torch.distributions.MultivariateNormal(torch.zeros_like(y), K + noise * eye).log_prob(y)


def operator_log_likelihood(op, y, noise):
    """GPyTorch's log N(y; 0, op + noise I) through linear_operator (inv_quad_logdet)."""
    from linear_operator.operators import AddedDiagLinearOperator, DiagLinearOperator

    cov = AddedDiagLinearOperator(op, DiagLinearOperator(noise.expand(y.shape[-1])))
    return gpytorch.distributions.MultivariateNormal(torch.zeros_like(y), cov).log_prob(y)


def exact_preconditioner(n):
    """Settings for a forced CG/SLQ route whose pivoted-Cholesky preconditioner is exact: the
    stochastic terms then cancel and value and gradient are those of the dense formula up to
    CG's tolerance."""
    import contextlib

    stack = contextlib.ExitStack()
    for setting in (
        gpytorch.settings.max_cholesky_size(0),
        gpytorch.settings.cg_tolerance(1e-12),
        gpytorch.settings.max_cg_iterations(10 * n),
        gpytorch.settings.max_preconditioner_size(n),
        gpytorch.settings.preconditioner_tolerance(1e-15),
        gpytorch.settings.min_preconditioning_size(1),
    ):
        stack.enter_context(setting)
    return stack


@pytest.mark.parametrize("kernel", ["rbf", "matern"])
@pytest.mark.parametrize("rows", [None, slice(13, 47)])
def test_bilinear_derivative_equals_autograd_of_the_dense_forms(kernel, rows):
    x, _, covar = gradient_problem(kernel=kernel)
    x = x.clone().requires_grad_(True)
    n = x.shape[0]
    gen = torch.Generator().manual_seed(3)
    first, stop = (0, n) if rows is None else (rows.start, rows.stop)
    left = torch.randn(stop - first, 4, generator=gen, dtype=DTYPE)
    right = torch.randn(n, 4, generator=gen, dtype=DTYPE)
    op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=7, rows=rows)
    grads = op._bilinear_derivative(left, right)
    params = list(covar.parameters())
    assert len(grads) == 1 + len(params)
    # the forms on the dense matrix, differentiated by autograd: sum_i u_i^T K v_i
    dense = covar(x, x).to_dense()[first:stop]
    form = (left * (dense @ right)).sum()
    expected = torch.autograd.grad(form, [x, *params])
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "rbf alone"])
@pytest.mark.parametrize("ard", [True, False], ids=["ard", "one lengthscale"])
@pytest.mark.parametrize("cache_bytes", [0, 10**7], ids=["evaluated", "kept rows"])
@pytest.mark.parametrize("rows", [None, slice(5, 50)])
def test_rbf_bilinear_derivative_in_closed_form_equals_autograd(scaled, ard, cache_bytes, rows):
    """The RBF kernel's derivative from its entries (inputs without a gradient), against
    autograd through GPyTorch's dense evaluation; from kept rows too."""
    gen = torch.Generator().manual_seed(5)
    n = 60
    x = 10 + 3 * torch.rand(n, 3, generator=gen, dtype=DTYPE)  # off-centre: the centring counts
    rbf = RBFKernel(ard_num_dims=3 if ard else None).to(DTYPE)
    rbf.lengthscale = torch.tensor([0.7, 1.1, 0.9] if ard else [0.8], dtype=DTYPE)
    covar = ScaleKernel(rbf).to(DTYPE) if scaled else rbf
    if scaled:
        covar.outputscale = 1.7
    first, stop = (0, n) if rows is None else (rows.start, rows.stop)
    left = torch.randn(stop - first, 4, generator=gen, dtype=DTYPE)
    right = torch.randn(n, 4, generator=gen, dtype=DTYPE)
    op = ChunkedKernelOperator(
        x, covar_module=covar, chunk_size=16, cache_bytes=cache_bytes, rows=rows
    )
    with torch.no_grad():
        op @ right  # the first product keeps the rows, where the budget allows
    assert (op.kept_bytes > 0) == (cache_bytes > 0)
    grads = op._bilinear_derivative(left, right)
    params = list(covar.parameters())
    form = (left * (covar(x, x).to_dense()[first:stop] @ right)).sum()
    expected = torch.autograd.grad(form, params)
    assert grads[0] is None
    for got, want in zip(grads[1:], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_rbf_closed_form_skips_a_frozen_lengthscale():
    x, _, covar = gradient_problem(n=30)
    covar.base_kernel.raw_lengthscale.requires_grad_(False)
    vecs = torch.randn(30, 2, dtype=DTYPE)
    grads = ChunkedKernelOperator(x, covar_module=covar)._bilinear_derivative(vecs, vecs)
    (expected,) = torch.autograd.grad(
        (vecs * (covar(x, x).to_dense() @ vecs)).sum(), [covar.raw_outputscale]
    )
    assert grads[2] is None
    torch.testing.assert_close(grads[1], expected, rtol=1e-10, atol=1e-12)


def test_bilinear_derivative_gives_none_where_nothing_requires_a_gradient():
    x, _, covar = gradient_problem()
    covar.requires_grad_(False)
    op = ChunkedKernelOperator(x, covar_module=covar)
    vecs = torch.ones(x.shape[0], 2, dtype=DTYPE)
    assert op._bilinear_derivative(vecs, vecs) == (None,) * 3


def test_marginal_likelihood_and_gradient_by_cg_equal_the_dense_cholesky_ones():
    x, y, covar = gradient_problem()
    noise = torch.tensor(0.05, dtype=DTYPE, requires_grad=True)
    params = [*covar.parameters(), noise]
    expected = dense_log_likelihood(covar, x, y, noise)
    expected_grads = torch.autograd.grad(expected, params)
    op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=16)
    with exact_preconditioner(x.shape[0]):
        value = operator_log_likelihood(op, y, noise)
        grads = torch.autograd.grad(value, params)
    torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-9)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-8)


@pytest.mark.filterwarnings("ignore:CG terminated")
def test_stochastic_log_determinant_gradient_agrees_within_its_probe_error():
    x, y, covar = gradient_problem()
    noise = torch.tensor(0.05, dtype=DTYPE, requires_grad=True)
    params = [*covar.parameters(), noise]
    flat = lambda grads: torch.stack([g.reshape(()) for g in grads])  # noqa: E731
    expected = flat(torch.autograd.grad(dense_log_likelihood(covar, x, y, noise), params))
    op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=16)
    settings = (
        gpytorch.settings.max_cholesky_size(0),
        gpytorch.settings.cg_tolerance(1e-6),
        gpytorch.settings.max_cg_iterations(60),
        gpytorch.settings.max_preconditioner_size(10),
        gpytorch.settings.min_preconditioning_size(1),
        gpytorch.settings.num_trace_samples(1000),
    )
    with settings[0], settings[1], settings[2], settings[3], settings[4], settings[5]:
        got = flat(torch.autograd.grad(operator_log_likelihood(op, y, noise), params))
    # 1000 probes: a relative error of a few percent of the trace term
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())


def test_dense_route_below_max_cholesky_size_differentiates_the_formed_matrix():
    x, y, covar = gradient_problem()
    noise = torch.tensor(0.05, dtype=DTYPE, requires_grad=True)
    params = [*covar.parameters(), noise]
    expected = dense_log_likelihood(covar, x, y, noise)
    expected_grads = torch.autograd.grad(expected, params)
    op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=16)
    with gpytorch.settings.max_cholesky_size(10_000):
        value = operator_log_likelihood(op, y, noise)
        grads = torch.autograd.grad(value, params)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_matrix_free_gradient_equals_central_finite_differences():
    x, y, covar = gradient_problem(n=40)
    raw = covar.base_kernel.raw_lengthscale
    op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=9)
    noise = torch.tensor(0.05, dtype=DTYPE)
    with exact_preconditioner(x.shape[0]):
        (grad,) = torch.autograd.grad(operator_log_likelihood(op, y, noise), [raw])
        h = 1e-5
        values = []
        for sign in (1, -1):
            with torch.no_grad():
                raw.add_(sign * h)
            values.append(operator_log_likelihood(op, y, noise).detach())
            with torch.no_grad():
                raw.sub_(sign * h)
    finite = (values[0] - values[1]) / (2 * h)
    torch.testing.assert_close(grad.reshape(()), finite, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernel", ["rbf", "matern"], ids=["closed form", "autograd chunks"])
def test_no_kernel_sized_tensor_is_kept_for_the_backward_pass(kernel):
    """A proxy for memory: every tensor the autograd graph saves, in the forward pass and in
    the backward pass's graphs (the chunks', for a kernel without the closed form), has at most N x max(chunk, probes + 1, d x preconditioner
    rank) entries (the last: the input pairs of the preconditioner's rows), far below N^2."""
    n, chunk, probes, rank = 300, 20, 10, 15
    x, y, covar = gradient_problem(n=n, kernel=kernel)
    noise = torch.tensor(0.05, dtype=DTYPE, requires_grad=True)
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=chunk)
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        gpytorch.settings.max_cholesky_size(0),
        gpytorch.settings.num_trace_samples(probes),
        gpytorch.settings.max_preconditioner_size(rank),
        gpytorch.settings.min_preconditioning_size(1),
    ):
        loss = -operator_log_likelihood(op, y, noise)
        forward_sizes = list(sizes)
        loss.backward()
    assert forward_sizes and len(sizes) > len(forward_sizes)  # the backward's graphs were seen
    assert max(sizes) <= n * max(chunk, probes + 1, x.shape[-1] * rank) < n * n / 4
    assert op.kept_bytes == 0
    assert all(p.grad is not None for p in covar.parameters()) and noise.grad is not None


@pytest.mark.parametrize("kernel", ["rbf", "matern"], ids=["closed form", "autograd chunks"])
def test_the_backward_pass_frees_the_kept_rows(kernel):
    """A training loop keeps a loss's graph until the next loss replaces it: its operator's
    rows are freed by the backward pass, which uses them, and its gradient is the one without
    kept rows."""
    n = 80
    x, y, covar = gradient_problem(n=n, kernel=kernel)
    noise = torch.tensor(0.05, dtype=DTYPE, requires_grad=True)
    grads = {}
    for cache_bytes in (0, n * n * 8):
        op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=16, cache_bytes=cache_bytes)
        with exact_preconditioner(n):
            loss = -operator_log_likelihood(op, y, noise)
        assert op.kept_bytes == (n * n * 8 if cache_bytes else 0)
        params = [*covar.parameters(), noise]
        grads[cache_bytes] = torch.autograd.grad(loss, params)
        assert op.kept_bytes == 0
        with torch.no_grad():  # the rows are evaluated again, and kept again
            op @ y.unsqueeze(-1)
        assert op.kept_bytes == (n * n * 8 if cache_bytes else 0)
    for kept, evaluated in zip(grads[n * n * 8], grads[0], strict=True):
        torch.testing.assert_close(kept, evaluated, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel", ["rbf", "matern"])
def test_float32_bilinear_derivative_agrees_with_float64_autograd(kernel):
    x, _, covar = gradient_problem(kernel=kernel)
    gen = torch.Generator().manual_seed(4)
    left = torch.randn(x.shape[0], 3, generator=gen, dtype=DTYPE)
    right = torch.randn(x.shape[0], 3, generator=gen, dtype=DTYPE)
    form = (left * (covar(x, x).to_dense() @ right)).sum()
    expected = torch.autograd.grad(form, list(covar.parameters()))
    covar32 = covar.float()
    op = ChunkedKernelOperator(x.float(), covar_module=covar32, chunk_size=16)
    got = op._bilinear_derivative(left.float(), right.float())[1:]
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-4 * e.abs().max().item())


def test_entries_and_diagonal_carry_the_gradient_of_the_kernels_own_evaluation():
    x, _, covar = gradient_problem(n=30)
    op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=8)
    rows = torch.tensor([[3], [7], [7]])
    cols = torch.tensor([[0, 7, 29]])
    entries = op[rows, cols]
    dense = covar(x, x).to_dense()
    torch.testing.assert_close(entries, dense[rows, cols], rtol=1e-12, atol=1e-12)
    raw = covar.base_kernel.raw_lengthscale
    (got,) = torch.autograd.grad(entries.sum() + op.diagonal().sum(), [raw])
    (want,) = torch.autograd.grad(dense[rows, cols].sum() + dense.diagonal().sum(), [raw])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_wrong_number_of_hyperparameters_is_refused():
    x, _, covar = gradient_problem(n=10)
    with pytest.raises(ValueError, match="one tensor per parameter of covar_module"):
        ChunkedKernelOperator(x, torch.ones(1), covar_module=covar)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_marginal_likelihood_gradient_on_cuda_equals_the_cpu_one():
    x, y, covar = gradient_problem()
    noise = torch.tensor(0.05, dtype=DTYPE)
    with exact_preconditioner(x.shape[0]):
        op = ChunkedKernelOperator(x, covar_module=covar, chunk_size=16)
        expected = torch.autograd.grad(operator_log_likelihood(op, y, noise), covar.parameters())
        covar_gpu = covar.cuda()
        op_gpu = ChunkedKernelOperator(x.cuda(), covar_module=covar_gpu, chunk_size=16)
        got = torch.autograd.grad(
            operator_log_likelihood(op_gpu, y.cuda(), noise.cuda()), covar_gpu.parameters()
        )
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.cpu(), e, rtol=1e-7, atol=1e-8)
