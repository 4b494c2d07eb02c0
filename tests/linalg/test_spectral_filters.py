import math
import warnings

import pytest
import torch
from gpr_reference import explicit_targets
from linear_operator.utils.warnings import PerformanceWarning

import gpsd
from gpsd.linalg import (
    KernelSpectrum,
    ShiftedCholesky,
    SpectralFilter,
    choose_backend,
    free_memory_bytes,
)

DTYPE = torch.float64


def rbf_matrix(n, lengthscale=1.0, seed=0, batch=()):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(*batch, n, 1, generator=gen, dtype=DTYPE)
    return torch.exp(-0.5 * (x - x.mT).square() / lengthscale**2)


@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_series_are_the_taylor_coefficients(alpha):
    """Coefficients at 0 against repeated autograd derivatives of the filter values."""
    gammas = torch.tensor([0.3, 0.7, 1.1], dtype=DTYPE)
    for filt in (
        SpectralFilter.data_centric_targets(gammas, alpha),
        SpectralFilter.data_centric_weights(gammas, alpha),
        SpectralFilter.resolvent(gammas),
    ):
        series = filt.series(4)  # shape: (3, 5)
        for t in range(3):

            def f(d, t=t, filt=filt):
                return filt.values(d.reshape(1))[t, 0]

            d0 = torch.zeros((), dtype=DTYPE, requires_grad=True)
            derivative = f(d0)
            for j in range(5):
                assert float(derivative.detach()) == pytest.approx(
                    float(series[t, j]) * math.factorial(j), rel=1e-10, abs=1e-12
                )
                if j < 4:
                    derivative = torch.autograd.grad(derivative, d0, create_graph=True)[0]


def test_dense_and_cholesky_apply_equal_explicit_matrices():
    k = rbf_matrix(50)
    gammas = torch.tensor([[0.2, 0.5, 0.5], [1.0, 0.1, 0.3]], dtype=DTYPE)
    rhs = torch.randn(50, 3, dtype=DTYPE)
    left = torch.randn(50, 4, dtype=DTYPE)
    for alpha in (0.0, 0.3):
        filt = SpectralFilter.data_centric_targets(gammas, alpha)
        expected = torch.stack([explicit_targets(k, g, alpha) for g in gammas]) @ rhs
        for engine in (KernelSpectrum.from_dense(k), ShiftedCholesky(k)):
            got = engine.apply(filt, rhs)
            assert got.shape == (2, 3, 50, 3)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(
                engine.cross(filt, left, rhs), left.T @ expected, rtol=1e-9, atol=1e-10
            )
            quad = torch.stack([explicit_targets(k, g, alpha) for g in gammas])
            expected_diag = (left.unsqueeze(0).unsqueeze(0) * (quad @ left)).sum(-2)
            torch.testing.assert_close(
                engine.quad_diag(filt, left), expected_diag, rtol=1e-9, atol=1e-10
            )
            torch.testing.assert_close(
                engine.trace(filt), quad.diagonal(dim1=-2, dim2=-1).sum(-1), rtol=1e-9, atol=1e-9
            )


def test_lanczos_on_a_batch_and_on_a_callable():
    k = rbf_matrix(200, batch=(2,))
    gammas = torch.tensor([0.3, 0.6], dtype=DTYPE)
    rhs = torch.randn(2, 200, 1, dtype=DTYPE)
    filt = SpectralFilter.data_centric_weights(gammas)
    dense = KernelSpectrum.from_dense(k)
    lanczos = KernelSpectrum.from_lanczos(k, rank=64, residual_tol=1e-9)
    assert lanczos.error_estimate(0.3) < 1e-8
    torch.testing.assert_close(
        lanczos.apply(filt, rhs), dense.apply(filt, rhs), rtol=1e-8, atol=1e-9
    )
    # The same through a bare matmul closure (how a KeOps or chunked operator plugs in).
    closure = KernelSpectrum.from_lanczos(
        lambda v: k @ v,
        size=200,
        batch_shape=(2,),
        dtype=DTYPE,
        rank=64,
        kernel_trace=k.diagonal(dim1=-2, dim2=-1).sum(-1),
    )
    torch.testing.assert_close(
        closure.apply(filt, rhs), dense.apply(filt, rhs), rtol=1e-8, atol=1e-9
    )
    torch.testing.assert_close(closure.trace(filt), dense.trace(filt), rtol=1e-8, atol=1e-8)


class CountingMatmul:
    """``X -> K X`` that counts its calls."""

    def __init__(self, k):
        self.k, self.calls = k, 0

    def __call__(self, v):
        self.calls += 1
        return self.k @ v


def lanczos_with_counter(k, rank, **kwargs):
    counter = CountingMatmul(k)
    spectrum = KernelSpectrum.from_lanczos(
        counter,
        size=k.shape[-1],
        batch_shape=k.shape[:-2],
        dtype=DTYPE,
        rank=rank,
        kernel_trace=k.diagonal(dim1=-2, dim2=-1).sum(-1),
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )
    return spectrum, counter


@pytest.mark.parametrize("rank", [32, 40, 44])
def test_complement_norm_bounds_bracket_the_dense_norm(rank):
    """Lower (largest unresolved Ritz value) <= ||P K P||_2 <= upper (trace bound), and the
    power-iteration estimate lies between, against the dense complement's eigenvalues."""
    k = rbf_matrix(300, lengthscale=0.5)
    spectrum, _ = lanczos_with_counter(k, rank, residual_tol=1e-9)
    v = spectrum.eigenvectors
    assert 0 < int(spectrum.num_resolved) < rank  # part of the Krylov space is unresolved
    proj = torch.eye(300, dtype=DTYPE) - v @ v.mT
    exact = float(torch.linalg.eigvalsh(proj @ k @ proj).abs().max())
    assert spectrum.complement_lower_bound <= exact * (1 + 1e-9)
    assert exact <= spectrum.complement_upper_bound
    assert spectrum.complement_lower_bound <= spectrum.complement_norm
    assert spectrum.complement_norm <= spectrum.complement_upper_bound
    assert spectrum.complement_norm == pytest.approx(exact, rel=0.05)


def test_a_spectrum_built_by_hand_estimates_its_complement_norm_on_first_read():
    k = rbf_matrix(300, lengthscale=0.5)
    ref, _ = lanczos_with_counter(k, 40, residual_tol=1e-9)
    spectrum = KernelSpectrum(
        ref.eigenvalues, ref.eigenvectors, matmul=lambda v: k @ v, complement_norm=None
    )
    v = ref.eigenvectors
    proj = torch.eye(300, dtype=DTYPE) - v @ v.mT
    exact = float(torch.linalg.eigvalsh(proj @ k @ proj).abs().max())
    assert spectrum.complement_norm == pytest.approx(exact, rel=0.05)


def test_small_trace_bound_skips_the_power_iterations():
    """A resolved spectrum: the trace bound serves as the complement norm, with no products."""
    k = rbf_matrix(200)
    spectrum, counter = lanczos_with_counter(k, 64, residual_tol=1e-9, complement_tol=1e-7)
    calls = counter.calls
    dense = torch.linalg.eigvalsh(k).flip(-1)
    tail = float(dense[int(spectrum.num_resolved) :].sum())  # = tr K_perp up to rounding
    assert spectrum.complement_norm <= 1e-7
    assert spectrum.complement_norm >= tail - 1e-12
    assert counter.calls == calls  # reading it ran no power iterations
    # Without the tolerance the first read runs the 12 power iterations, once.
    spectrum, counter = lanczos_with_counter(k, 64, residual_tol=1e-9)
    calls = counter.calls
    assert spectrum.complement_norm < 1e-7
    assert counter.calls == calls + 12
    assert spectrum.complement_norm < 1e-7
    assert counter.calls == calls + 12


def test_meets_decides_from_the_bounds_before_any_power_iteration():
    k = rbf_matrix(300, lengthscale=0.3)
    spectrum, counter = lanczos_with_counter(k, 16, residual_tol=1e-10)
    calls = counter.calls
    assert spectrum.complement_lower_bound > 1e-2  # far from resolved
    assert not spectrum.meets(1e-2, 1e-6)
    assert counter.calls == calls  # the lower bound sufficed
    # A huge shift: the trace bound alone meets rtol and becomes the complement norm.
    assert spectrum.meets(1e6, 1e-3)
    assert spectrum.complement_norm == spectrum.complement_upper_bound
    assert counter.calls == calls


def test_meets_runs_the_power_iterations_only_where_the_bounds_leave_it_open():
    k = rbf_matrix(300, lengthscale=0.5)
    spectrum, counter = lanczos_with_counter(k, 44, residual_tol=1e-9)
    calls = counter.calls
    low, up = spectrum.complement_lower_bound, spectrum.complement_upper_bound
    rtol = 0.5 * (low + up)  # gamma = 1: the lower bound meets it, the upper one does not
    assert spectrum._error_for(low, 1.0) < rtol < spectrum._error_for(up, 1.0, order=0)
    assert not spectrum.meets(1.0, rtol, allow_power=False)
    assert counter.calls == calls
    assert spectrum.meets(1.0, rtol) == (spectrum.error_estimate(1.0) <= rtol)
    assert counter.calls == calls + 12


def test_stop_when_ends_the_krylov_run_at_a_checkpoint_with_fewer_products():
    k = rbf_matrix(400)  # smooth: a few blocks resolve it
    gammas = torch.tensor([0.05, 0.1], dtype=DTYPE)
    rhs = torch.randn(400, 2, dtype=DTYPE)
    filt = SpectralFilter.data_centric_weights(gammas)
    looked_at = []

    def stop(spectrum):
        looked_at.append(int(spectrum.ritz_values.shape[-1]))
        return spectrum.meets(0.05, 1e-8, allow_power=False)

    early, counter = lanczos_with_counter(
        k, 256, block_size=32, residual_tol=1e-11, complement_tol=1e-10, stop_when=stop
    )
    full, full_counter = lanczos_with_counter(k, 256, block_size=32, residual_tol=1e-11)
    assert full_counter.calls == 9  # the start and 8 blocks
    assert counter.calls == 1 + looked_at[-1] // 32 < 9
    assert looked_at == [64, 96, 128, 192][: len(looked_at)]  # after 2, 3, 4, 6 blocks
    assert early.error_estimate(0.05) <= 1e-8
    dense = KernelSpectrum.from_dense(k)
    torch.testing.assert_close(early.apply(filt, rhs), dense.apply(filt, rhs), rtol=1e-7, atol=1e-9)
    # A test that never passes runs the whole basis.
    never, counter = lanczos_with_counter(k, 256, block_size=32, stop_when=lambda s: False)
    assert counter.calls == 9 and never.ritz_values.shape[-1] == 256


def test_lanczos_divergent_complement_raises():
    k = rbf_matrix(300, lengthscale=0.3)
    spectrum = KernelSpectrum.from_lanczos(k, rank=8, residual_tol=1e-10)
    assert math.isinf(spectrum.error_estimate(1e-3))
    with pytest.raises(ValueError, match="rank"):
        spectrum.check_accuracy(1e-3, 1e-6)
    with pytest.raises(ValueError, match="rank"):
        KernelSpectrum.from_lanczos(k, rank=0)


def test_dense_eigendecomposition_runs_in_float64_by_default():
    k = rbf_matrix(30).float()
    assert KernelSpectrum.from_dense(k).eigenvalues.dtype == torch.float64
    assert KernelSpectrum.from_dense(k, dtype=None).eigenvalues.dtype == torch.float32


def test_choose_backend():
    plenty = 2**50
    assert choose_backend(1000, 3, "cpu", free_bytes=plenty) == "cholesky"
    assert choose_backend(1000, 100, "cpu", free_bytes=plenty) == "dense"
    assert choose_backend(100_000, 100, "cpu", free_bytes=plenty) == "lanczos"
    # CUDA, as calibrated on an H200 (benchmarks/results/backend_choice_cuda.md)
    assert choose_backend(8192, 3, "cuda", free_bytes=plenty) == "cholesky"
    assert choose_backend(4096, 30, "cuda", free_bytes=plenty) == "dense"
    assert choose_backend(8192, 10, "cuda", free_bytes=plenty) == "lanczos"
    assert choose_backend(16_384, 3, "cuda", free_bytes=plenty) == "lanczos"


def test_choose_backend_leaves_dense_backends_that_do_not_fit_in_memory(use_setting):
    # the memory rules, at thresholds that let every backend be chosen at n = 20,000
    use_setting(gpsd.settings.max_chain_factorisations(cpu=3, cuda=30))
    use_setting(gpsd.settings.dense_max_n(cpu=12_000, cuda=30_000))
    n, gib = 20_000, 2**30
    matrix = n * n * 8  # one float64 N x N matrix: 3.2 GB
    # eigh needs 4 matrices within 80 % of the free memory.
    assert choose_backend(n, 100, "cuda", free_bytes=80 * gib) == "dense"
    assert choose_backend(n, 100, "cuda", free_bytes=int(4 * matrix / 0.8) - 1) == "lanczos"
    assert choose_backend(n, 100, "cuda", free_bytes=int(4 * matrix / 0.8) + 1) == "dense"
    # The chain's T = 4 factors must fit in half of what the matrix and one more factor leave:
    # 4 <= (free - 2) / 2 matrices, so free >= 10 matrices.
    assert choose_backend(n, 4, "cuda", free_bytes=10 * matrix) == "cholesky"
    assert choose_backend(n, 4, "cuda", free_bytes=10 * matrix - 1) == "dense"
    # Four schedules: one step's factor holds four matrices; 1 + 4 + 2 * 4 = 13 do not fit.
    assert choose_backend(n, 4, "cuda", num_schedules=4, free_bytes=12 * matrix) == "dense"
    assert choose_backend(n, 4, "cuda", num_schedules=4, free_bytes=13 * matrix) == "cholesky"
    # float32 halves the footprint; a batch of 4 kernel matrices quadruples it.
    assert choose_backend(n, 100, "cuda", torch.float32, free_bytes=8 * gib) == "dense"
    assert choose_backend(n, 100, "cuda", torch.float64, free_bytes=8 * gib) == "lanczos"
    assert choose_backend(n, 100, "cuda", batch_size=4, free_bytes=50 * gib) == "lanczos"

    # A schedule batch (3, 1) against a kernel batch (2,): a factor holds 3 x 2 = 6 matrices.
    # T = 4 factors in half of what 2 matrices and one more factor leave: 2 + 6 + 2 * 24 = 56.
    sizes = {"batch_size": 2, "num_schedules": 3, "factor_batch_size": 6}
    assert choose_backend(n, 12, "cuda", free_bytes=56 * matrix, **sizes) == "cholesky"
    assert choose_backend(n, 12, "cuda", free_bytes=56 * matrix - 1, **sizes) == "dense"
    # before, the factor was taken as max(2, 3) = 3 matrices: 2 + 3 + 2 * 12 = 29 sufficed
    assert choose_backend(n, 12, "cuda", batch_size=2, num_schedules=3, free_bytes=29 * matrix) == (
        "cholesky"
    )


@pytest.mark.parametrize(
    "argument", ["n", "num_factorisations", "batch_size", "num_schedules", "factor_batch_size"]
)
def test_choose_backend_names_a_bad_count(argument):
    kwargs = {
        "n": 100,
        "num_factorisations": 3,
        "batch_size": 1,
        "num_schedules": 1,
        "factor_batch_size": 1,
    }
    kwargs[argument] = 0
    with pytest.raises(ValueError, match=argument):
        choose_backend(device="cpu", **kwargs)


def test_free_memory_bytes_is_positive_on_the_cpu():
    free = free_memory_bytes("cpu")
    assert isinstance(free, int) and free > 0


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_headroom_reads_v2_and_v1_limits(tmp_path):
    """A container's memory limit bounds the CPU's free memory: before, only the host's
    MemAvailable was read, so backend='auto' could plan a dense matrix that the limit kills."""
    from gpsd.linalg.memory import _cgroup_headroom_bytes

    gib = 2**30
    v2 = tmp_path / "v2"
    stat = "anon 1\ninactive_file 1073741824\nactive_file 5\n"
    _write(
        v2, {"memory.max": f"{8 * gib}\n", "memory.current": f"{3 * gib}\n", "memory.stat": stat}
    )
    assert _cgroup_headroom_bytes(str(v2)) == 8 * gib - (3 * gib - gib)  # the cache is reclaimable
    _write(v2, {"memory.max": "max\n"})
    assert _cgroup_headroom_bytes(str(v2)) is None
    v1 = tmp_path / "v1"
    _write(
        v1,
        {
            "memory/memory.limit_in_bytes": f"{4 * gib}\n",
            "memory/memory.usage_in_bytes": f"{5 * gib}\n",  # over the limit: nothing left
            "memory/memory.stat": "cache 9\ntotal_inactive_file 0\n",
        },
    )
    assert _cgroup_headroom_bytes(str(v1)) == 0
    _write(v1, {"memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert _cgroup_headroom_bytes(str(v1)) is None
    assert _cgroup_headroom_bytes(str(tmp_path / "absent")) is None


def test_free_memory_bytes_takes_the_smaller_of_host_and_cgroup(monkeypatch):
    import gpsd.linalg.memory as backend

    monkeypatch.setattr(backend, "_host_available_bytes", lambda: 2**30)
    monkeypatch.setattr(backend, "_cgroup_headroom_bytes", lambda: 2**20)
    assert free_memory_bytes("cpu") == 2**20
    monkeypatch.setattr(backend, "_cgroup_headroom_bytes", lambda: 2**40)
    assert free_memory_bytes("cpu") == 2**30
    monkeypatch.setattr(backend, "_cgroup_headroom_bytes", lambda: None)
    assert free_memory_bytes("cpu") == 2**30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_free_memory_bytes_counts_the_allocators_unused_cache():
    device = torch.device("cuda")
    block = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB
    before = free_memory_bytes(device)
    del block  # returns to PyTorch's cache, not to the driver
    after = free_memory_bytes(device)
    assert after - before >= 2**28 - 2**21


def test_to_linear_operator_equals_explicit_filter_matrices():
    k = rbf_matrix(40)
    gammas = torch.tensor([0.2, 0.7], dtype=DTYPE)
    op = KernelSpectrum.from_dense(k).to_linear_operator(
        SpectralFilter.data_centric_targets(gammas)
    )
    assert op.shape == (2, 40, 40)
    torch.testing.assert_close(
        op.to_dense(), explicit_targets(k, gammas, 0.0), rtol=1e-9, atol=1e-10
    )
    rhs = torch.randn(40, 2, dtype=DTYPE)
    torch.testing.assert_close(
        op @ rhs, explicit_targets(k, gammas, 0.0) @ rhs, rtol=1e-9, atol=1e-10
    )
    with pytest.raises(ValueError, match="full eigendecomposition"):
        KernelSpectrum.from_lanczos(k, rank=16).to_linear_operator(SpectralFilter.resolvent(gammas))


def test_chunked_kernel_operator_products_and_diagonal():
    import gpytorch

    from gpsd.linalg import ChunkedKernelOperator

    x = torch.rand(2, 130, 3, dtype=DTYPE)
    kernel = gpytorch.kernels.MaternKernel(batch_shape=torch.Size([2])).to(DTYPE)
    op = ChunkedKernelOperator(x, kernel=kernel, chunk_size=32)
    dense = kernel(x).to_dense().detach()
    rhs = torch.randn(2, 130, 4, dtype=DTYPE)
    assert op.shape == (2, 130, 130)
    torch.testing.assert_close(op @ rhs, dense @ rhs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.diagonal(dim1=-2, dim2=-1), dense.diagonal(dim1=-2, dim2=-1))
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedKernelOperator(x, kernel=kernel, chunk_size=0)


def test_cholesky_keeps_its_factors_within_the_memory_it_is_given():
    k = rbf_matrix(60, lengthscale=0.5)
    gammas = torch.linspace(0.1, 1.0, 6, dtype=DTYPE)
    rhs = torch.randn(60, 2, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    left = torch.randn(60, 4, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    factor_bytes = 60 * 60 * 8
    small = ShiftedCholesky(k, max_cached_bytes=2 * factor_bytes)
    filt = SpectralFilter.data_centric_targets(gammas, 0.2)
    expected = explicit_targets(k, gammas, 0.2) @ rhs
    torch.testing.assert_close(small.apply(filt, rhs), expected, rtol=1e-9, atol=1e-10)
    assert len(small._factors) == 2  # six shifts factored, two kept
    resolvent = SpectralFilter.resolvent(gammas)
    eye = torch.eye(60, dtype=DTYPE)
    solves = torch.stack([torch.linalg.solve(k + g * eye, left) for g in gammas])
    with pytest.warns(PerformanceWarning, match="dropped from its cache"):
        quad = small.quad_diag(resolvent, left)  # the six shifts again: refactored
    torch.testing.assert_close(quad, (left * solves).sum(-2), rtol=1e-9, atol=1e-10)
    assert len(small._factors) == 2
    default = ShiftedCholesky(k)  # half the free memory: all six fit
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        default.apply(filt, rhs)
        default.quad_diag(resolvent, left)
    assert len(default._factors) == 6 and default.max_cached_bytes > 6 * factor_bytes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "rank must be a positive int"),
        (dict(rank=8.0), "rank"),
        (dict(block_size=0), "block_size must be a positive integer or None"),
        (dict(block_size=-2), "block_size"),
    ],
)
def test_lanczos_sizes_are_checked(kwargs, match):
    k = torch.eye(10, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        KernelSpectrum.from_lanczos(k, **kwargs)
