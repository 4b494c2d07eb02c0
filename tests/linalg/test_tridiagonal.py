"""The eigendecomposition through the tridiagonal reduction: against the defining identities."""

import numpy as np
import pytest
import torch
from gpr_reference import random_rbf_matrix

from gpsd.linalg._tridiagonal import tridiagonal_eigh


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-11), (torch.float32, 2e-4)])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_factors_diagonalise_the_matrix(dtype, tol, batch):
    """V = Q Z is orthonormal and K V = V diag(d), with d the eigenvalues numpy finds."""
    k = random_rbf_matrix(120, lengthscale=0.7, seed=3, batch=batch).to(dtype)
    evals, v = tridiagonal_eigh(k)
    assert evals.shape == (*batch, 120) and v.shape == (*batch, 120, 120)
    eye = torch.eye(120, dtype=dtype)
    scale = float(k.abs().max())
    assert float((v.mT @ v - eye).abs().max()) < tol
    assert float((k @ v - v * evals.unsqueeze(-2)).abs().max()) < tol * scale
    reference = np.linalg.eigvalsh(k.double().numpy())  # LAPACK syevd, ascending
    assert float((evals.double() - torch.from_numpy(reference)).abs().max()) < tol * scale


def test_reads_only_the_upper_triangle_and_handles_one_point():
    k = random_rbf_matrix(30, seed=5)
    corrupted = torch.triu(k) + torch.tril(torch.full_like(k, 7.0), -1)
    evals, _ = tridiagonal_eigh(corrupted)
    assert torch.allclose(evals, torch.linalg.eigvalsh(k), atol=1e-12)
    one = torch.full((1, 1), 2.5, dtype=torch.float64)
    evals, vectors = tridiagonal_eigh(one)
    assert evals.tolist() == [2.5] and vectors.tolist() == [[1.0]]


def test_a_large_cluster_of_equal_eigenvalues_is_diagonalised():
    """Isolated points under a short lengthscale: K is nearly the identity, a cluster of
    hundreds of eigenvalues equal to rounding, which divide and conquer deflates."""
    gen = torch.Generator().manual_seed(2)
    x = 100 * torch.rand(300, 2, generator=gen, dtype=torch.float64)
    k = torch.exp(-torch.cdist(x, x).square() / (2 * 0.05**2))
    evals, v = tridiagonal_eigh(k)
    eye = torch.eye(300, dtype=torch.float64)
    assert float((v.mT @ v - eye).abs().max()) < 1e-12
    assert float((k @ v - v * evals.unsqueeze(-2)).abs().max()) < 1e-12
    reference = torch.from_numpy(np.linalg.eigvalsh(k.numpy()))
    assert float((evals - reference).abs().max()) < 1e-12
    assert int(((evals - 1.0).abs() < 1e-12).sum()) > 250
