"""The eigendecomposition through the tridiagonal reduction: against the defining identities."""

import numpy as np
import pytest
import torch
from gpr_reference import random_rbf_matrix

from gpsd.linalg._tridiagonal import tridiagonal_eigh


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-11), (torch.float32, 2e-4)])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_formed_eigenvectors_diagonalise_the_matrix(dtype, tol, batch):
    """V = Q Z is orthonormal and K V = V diag(d), with d numpy's eigenvalues, descending."""
    k = random_rbf_matrix(120, lengthscale=0.7, seed=3, batch=batch).to(dtype)
    evals, vectors = tridiagonal_eigh(k)
    v = vectors.dense()
    assert evals.shape == (*batch, 120) and v.shape == (*batch, 120, 120)
    eye = torch.eye(120, dtype=dtype)
    scale = float(k.abs().max())
    assert float((v.mT @ v - eye).abs().max()) < tol
    assert float((k @ v - v * evals.unsqueeze(-2)).abs().max()) < tol * scale
    reference = np.linalg.eigvalsh(k.double().numpy())[..., ::-1]  # LAPACK syevd
    assert float((evals.double() - torch.from_numpy(reference.copy())).abs().max()) < tol * scale


@pytest.mark.parametrize("batch", [(), (2,)])
def test_products_through_the_reflectors_equal_those_with_the_formed_eigenvectors(batch):
    """Before V is formed, V^T B and V C go through the reflectors and Z: they are orthogonal
    (V V^T B = B), diagonalise K (V^T K B = D V^T B), and equal the products with V formed."""
    k = random_rbf_matrix(80, lengthscale=0.6, seed=4, batch=batch)
    evals, vectors = tridiagonal_eigh(k)
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(*batch, 80, 3, generator=gen, dtype=k.dtype)
    coefficients = vectors.t_matmul(b)
    back = vectors.matmul(coefficients)
    through_k = vectors.t_matmul(k @ b)
    assert not vectors.is_formed
    torch.testing.assert_close(back, b, rtol=0, atol=1e-12)
    torch.testing.assert_close(through_k, evals.unsqueeze(-1) * coefficients, rtol=0, atol=1e-12)
    v = vectors.dense()
    torch.testing.assert_close(coefficients, v.mT @ b, rtol=0, atol=1e-12)
    torch.testing.assert_close(back, v @ coefficients, rtol=0, atol=1e-12)


def test_products_broadcast_over_a_batch_the_eigenvectors_lack():
    k = random_rbf_matrix(40, seed=6)
    _, vectors = tridiagonal_eigh(k)
    b = torch.randn(3, 40, 2, dtype=k.dtype)
    coefficients = vectors.t_matmul(b)
    assert coefficients.shape == (3, 40, 2)
    torch.testing.assert_close(coefficients[1], vectors.t_matmul(b[1]), rtol=0, atol=1e-14)


def test_eigenvectors_are_formed_once_the_reflectors_have_multiplied_n_columns():
    """Forming V costs 2 N^3 flops, as many as N columns through the reflectors: it is formed
    when the columns multiplied reach N, and products use it from then on."""
    k = random_rbf_matrix(50, seed=7)
    _, vectors = tridiagonal_eigh(k)
    b = torch.randn(50, 20, dtype=k.dtype)
    vectors.t_matmul(b)
    vectors.matmul(b)
    assert not vectors.is_formed  # 40 columns
    before = vectors.t_matmul(b[:, :9])
    assert not vectors.is_formed  # 49 columns
    after = vectors.t_matmul(b[:, :9])
    assert vectors.is_formed  # 58 columns
    torch.testing.assert_close(after, before, rtol=0, atol=1e-13)


def test_reads_only_the_upper_triangle_and_handles_one_point():
    k = random_rbf_matrix(30, seed=5)
    corrupted = torch.triu(k) + torch.tril(torch.full_like(k, 7.0), -1)
    evals, _ = tridiagonal_eigh(corrupted)
    assert torch.allclose(evals, torch.linalg.eigvalsh(k).flip(-1), atol=1e-12)
    one = torch.full((1, 1), 2.5, dtype=torch.float64)
    evals, vectors = tridiagonal_eigh(one)
    assert evals.tolist() == [2.5] and vectors.dense().tolist() == [[1.0]]
    assert vectors.t_matmul(torch.tensor([[3.0]], dtype=torch.float64)).tolist() == [[3.0]]
