"""The matrix-free backends (Lanczos, deflated CG) inside the regression distillers."""

import warnings

import gpytorch
import numpy as np
import pytest
import torch
from gpr_reference import matern_regression_problem, rbf_kernel, relative_error
from gpytorch.utils.warnings import NumericalWarning

import gpsd
import gpsd.linalg.backend as backend_module
from gpsd import DataCentricGPR, DistributionCentricGPR
from gpsd.linalg import KernelSpectrum, ShiftedCG

DTYPE = torch.float64


def wiggly_data(n=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(3 * x.squeeze(-1)) + 0.05 * torch.randn(n, generator=gen, dtype=DTYPE)
    return x, y, torch.linspace(0, 10, 77, dtype=DTYPE).unsqueeze(-1)


@pytest.fixture
def small_dense_limit():
    """Pretend N = 300 is beyond a dense decomposition, and cap Lanczos at rank 32."""
    with gpsd.settings.dense_max_n(100), gpsd.settings.max_lanczos_rank(32):
        yield


def test_auto_beyond_dense_size_switches_to_deflated_cg_and_stays_exact(small_dense_limit):
    x, y, test_x = wiggly_data()
    gammas = torch.full((14,), 1e-2, dtype=DTYPE)  # 14 > 3 factorisations: no Cholesky chain
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.1)
    auto = DataCentricGPR(x, y, kernel, noise=gammas, rtol=1e-10)
    dense = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        got, ref = auto.predict(test_x), dense.predict(test_x)
        assert isinstance(auto._state()["engine"], ShiftedCG)
        got_targets, ref_targets = auto.step_targets(), dense.step_targets()
    assert relative_error(got.mean, ref.mean) < 1e-7
    assert relative_error(got.variance, ref.variance) < 1e-7
    assert relative_error(got_targets, ref_targets) < 1e-7


def test_auto_beyond_dense_size_keeps_lanczos_for_a_smooth_kernel(small_dense_limit):
    x, y, test_x = wiggly_data()
    kernel = rbf_kernel(outputscale=1.0, lengthscale=3.0)
    auto = DataCentricGPR(x, y, kernel, noise=torch.full((30,), 0.1, dtype=DTYPE))
    with torch.no_grad():
        auto.predict(test_x)
        engine = auto._state()["engine"]
    assert isinstance(engine, KernelSpectrum) and engine.is_truncated


def test_grown_lanczos_stops_once_accurate_and_agrees_with_dense(monkeypatch):
    """Without rank= the Krylov basis grows block by block and stops once the estimate meets
    rtol: a smooth kernel takes a few passes over K, not the whole rank-1024 budget."""
    from gpsd.linalg import ChunkedKernelOperator

    passes = []
    matmul = ChunkedKernelOperator._matmul

    def counting(self, rhs):
        passes.append(rhs.shape[-1])
        return matmul(self, rhs)

    monkeypatch.setattr(ChunkedKernelOperator, "_matmul", counting)
    gen = torch.Generator().manual_seed(3)
    x = 10 * torch.rand(1500, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(x.squeeze(-1)) + 0.3 * torch.randn(1500, generator=gen, dtype=DTYPE)
    test_x = torch.linspace(0, 10, 60, dtype=DTYPE).unsqueeze(-1)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0)
    gammas = torch.linspace(0.05, 0.5, 6, dtype=DTYPE)
    lanczos = DataCentricGPR(x, y, kernel, noise=gammas, backend="lanczos")
    dense = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        got, ref = lanczos.predict(test_x), dense.predict(test_x)
        estimate = lanczos.error_estimate
    assert estimate <= lanczos.rtol
    assert len(passes) <= 5  # the start block and at most 4 blocks of 64 columns
    assert relative_error(got.mean, ref.mean) < 10 * lanczos.rtol
    assert relative_error(got.variance, ref.variance) < 10 * lanczos.rtol


def test_auto_gives_up_a_hopeless_lanczos_attempt_at_half_its_budget(monkeypatch):
    """A slowly decaying spectrum: every Ritz value stays above the series' threshold, so the
    attempt before the dense eigendecomposition stops at half its rank budget of N / 4."""
    runs = []
    from_lanczos = KernelSpectrum.from_lanczos.__func__

    def recording(cls, *args, **kwargs):
        spectrum = from_lanczos(cls, *args, **kwargs)
        runs.append((kwargs["rank"], spectrum.ritz_values.shape[-1]))
        return spectrum

    monkeypatch.setattr(KernelSpectrum, "from_lanczos", classmethod(recording))
    gen = torch.Generator().manual_seed(4)
    x = 10 * torch.rand(600, 2, generator=gen, dtype=DTYPE)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(600, generator=gen, dtype=DTYPE)
    test_x = 10 * torch.rand(40, 2, generator=gen, dtype=DTYPE)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.1)
    gammas = torch.linspace(0.1, 1.0, 10, dtype=DTYPE)
    auto = DataCentricGPR(x, y, kernel, noise=gammas)
    dense = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        got, ref = auto.predict(test_x), dense.predict(test_x)
        engine = auto._state()["engine"]
    assert isinstance(engine, KernelSpectrum) and not engine.is_truncated  # fell back to eigh
    assert len(runs) == 1
    budget, columns = runs[0]
    assert budget == 150
    assert budget / 2 <= columns < budget  # stopped at the first checkpoint past half
    assert relative_error(got.mean, ref.mean) < 1e-12
    assert relative_error(got.variance, ref.variance) < 1e-12


def test_out_of_reach_only_past_half_the_budget_and_only_above_the_threshold():
    gen = torch.Generator().manual_seed(5)
    x = 10 * torch.rand(300, 1, generator=gen, dtype=DTYPE)
    smooth = rbf_kernel(outputscale=1.0, lengthscale=1.0)(x).to_dense()
    rough = rbf_kernel(outputscale=1.0, lengthscale=0.01)(x).to_dense()
    for k, hopeless in ((smooth, False), (rough, True)):
        spectrum = KernelSpectrum.from_lanczos(k, rank=64, residual_tol=1e-8)
        assert backend_module._out_of_reach(spectrum, 128, 0.1, 1e-6) is hopeless
        assert backend_module._out_of_reach(spectrum, 129, 0.1, 1e-6) is False  # 64 < 129 / 2


def test_auto_goes_matrix_free_when_the_dense_matrix_would_not_fit(monkeypatch, use_setting):
    one_mib = 2**20
    monkeypatch.setattr(backend_module, "free_memory_bytes", lambda device, wanted=None: one_mib)
    use_setting(gpsd.settings.max_lanczos_rank(32))
    x, y, test_x = wiggly_data()  # one 300 x 300 float64 matrix: 0.7 MiB
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.1)
    gammas = torch.full((3,), 1e-2, dtype=DTYPE)  # few steps: the Cholesky chain if it fitted
    auto = DataCentricGPR(x, y, kernel, noise=gammas, rtol=1e-10)
    dense = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        got, ref = auto.predict(test_x), dense.predict(test_x)
        assert isinstance(auto._state()["engine"], ShiftedCG)
    assert relative_error(got.mean, ref.mean) < 1e-7
    assert relative_error(got.variance, ref.variance) < 1e-7


@pytest.mark.parametrize("backend", ["lanczos", "cg"])
def test_a_backward_pass_through_a_matrix_free_backend_raises_a_backend_error(backend):
    """No partial graph (through the cross-covariance or the prior mean alone, which would give
    wrong gradients) and no silent lack of one: the values are right, the backward refused."""
    x, y, test_x = wiggly_data(n=200)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=2.0)
    mean = gpytorch.means.ConstantMean().to(DTYPE)
    model = DataCentricGPR(
        x, y, kernel, noise=[0.1, 0.1], mean_module=mean, backend=backend, rank=64
    )
    dense = DataCentricGPR(x, y, kernel, noise=[0.1, 0.1], mean_module=mean, backend="dense")
    got, ref = model.predict(test_x), dense.predict(test_x)
    assert relative_error(got.mean.detach(), ref.mean.detach()) < 1e-6
    assert relative_error(got.variance.detach(), ref.variance.detach()) < 1e-6
    for out in (got.mean, got.variance, model.gcv() if backend == "lanczos" else got.mean):
        with pytest.raises(gpsd.BackendError, match="backend='dense' or 'cholesky'"):
            out.sum().backward()
    ref.mean.sum().backward()  # the dense backend differentiates
    assert kernel.base_kernel.raw_lengthscale.grad is not None
    # under no_grad, or with no parameter requiring grad, nothing carries a graph
    with torch.no_grad():
        assert not model.predict(test_x).mean.requires_grad
    for p in (*kernel.parameters(), *mean.parameters()):
        p.requires_grad_(False)
    assert not model.predict(test_x).mean.requires_grad


def test_distribution_centric_cg_matches_dense_on_a_hard_spectrum():
    x, y, test_x = wiggly_data()
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.1)
    gammas = torch.linspace(0.01, 0.1, 4, dtype=DTYPE)
    cg = DistributionCentricGPR(x, y, kernel, noise=gammas, backend="cg", rank=16, rtol=1e-11)
    dense = DistributionCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        got, ref = cg.predict(test_x), dense.predict(test_x)
    assert relative_error(got.mean, ref.mean) < 1e-7
    assert relative_error(got.variance, ref.variance) < 1e-7


def test_cg_gcv_and_out_of_memory_name_the_way_out(monkeypatch):
    x, y, _ = wiggly_data(n=100)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="cg", rank=8)
    with torch.no_grad(), pytest.raises(ValueError, match="gcv"):
        model.gcv()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(KernelSpectrum, "from_lanczos", out_of_memory)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1], backend="cg", rank=8)
    with torch.no_grad(), pytest.raises(MemoryError, match="smaller rank="):
        model.predict(x[:5])


@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg"])
def test_predict_mean_equals_the_mean_of_predict_across_chunks(backend, use_setting):
    use_setting(gpsd.settings.test_chunk_size(30))  # 77 test points: three chunks
    x, y, test_x = wiggly_data(n=200)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0)
    model = DataCentricGPR(
        x, y, kernel, noise=[0.05, 0.1, 0.2], backend=backend, rank=32, rtol=1e-10
    )
    dist = DistributionCentricGPR(
        x, y, kernel, noise=[0.05, 0.1], backend=backend, rank=32, rtol=1e-10
    )
    with torch.no_grad():
        for m in (model, dist):
            means = m.predict_mean(test_x)
            assert means.shape == (m.num_steps, 77)
            assert relative_error(means, m.predict(test_x).mean) < 1e-12
        val_y = torch.sin(3 * test_x.squeeze(-1))
        expected = (model.predict(test_x).mean - val_y).square().mean(-1)
        assert relative_error(model.validation_mse(test_x, val_y), expected) < 1e-12


@pytest.mark.parametrize("backend", ["lanczos", "cg"])
def test_grad_mode_does_not_make_the_matrix_free_cache_stale(backend, monkeypatch):
    """With grad enabled (no ``torch.no_grad()``), the factorisation is built once, and no output
    carries a partial graph, not even through a trainable prior mean."""

    builds = []
    make_engine = gpsd.linalg.make_engine
    monkeypatch.setattr(
        gpsd.linalg, "make_engine", lambda *a, **k: builds.append(1) or make_engine(*a, **k)
    )
    x, y, test_x = wiggly_data(n=200)
    mean = gpytorch.means.ConstantMean().to(DTYPE)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=2.0)
    model = DataCentricGPR(
        x, y, kernel, noise=[0.1, 0.2], mean_module=mean, backend=backend, rank=64
    )
    outputs = [model.predict(test_x).mean, model.predict_mean(test_x), model.step_targets()]
    outputs.append(model.predict(test_x).variance)
    assert len(builds) == 1
    for out in outputs:  # no graph through the matrix-free engine: a backward pass is refused
        with pytest.raises(gpsd.BackendError, match="'dense' or 'cholesky'"):
            out.sum().backward()


def test_explicit_lanczos_stops_growing_and_names_the_matrix_free_way_out(
    small_dense_limit, monkeypatch
):
    ranks = []
    original = KernelSpectrum.from_lanczos

    def spy(*args, **kwargs):
        ranks.append(kwargs["rank"])
        return original(*args, **kwargs)

    monkeypatch.setattr(KernelSpectrum, "from_lanczos", spy)
    x, y, test_x = wiggly_data()
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.1)  # flat spectrum: rank 32 cannot do
    model = DataCentricGPR(x, y, kernel, noise=[1e-2, 1e-2], backend="lanczos")
    with torch.no_grad(), pytest.raises(ValueError, match="backend='cg'"):
        model.predict(test_x)
    assert max(ranks) == 32  # the cap, not N = 300


def test_lanczos_over_the_whole_space_does_not_advise_a_higher_rank():
    """The advice is not "raise rank=" with the Krylov space already all of R^N, and Ritz pairs
    at rounding level count as resolved (a warning, not an error).

    At noise 1e-9 rounding dominates: every backend errs by about eps * lambda_max / noise
    relative, which :attr:`error_estimate` leaves out by its definition (it bounds the
    truncation). The dense reference carries that rounding too, so the Lanczos result is held to
    its estimate plus the spread of the two direct backends (dense and Cholesky, both exact in
    exact arithmetic), which measures the rounding at this noise (7e-5, against an estimate of
    4e-5 and a Lanczos-dense difference of 4e-5).
    """
    x, y, test_x = wiggly_data(n=30)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[1e-9] * 3, backend="lanczos")
    with torch.no_grad(), pytest.warns(NumericalWarning, match="a higher rank= cannot help") as rec:
        got = model.predict_mean(test_x)
    message = str(rec[0].message)
    assert "all N = 30 dimensions" in message and "raise rank" not in message
    with torch.no_grad():
        dense, cholesky = (
            DataCentricGPR(x, y, rbf_kernel(), noise=[1e-9] * 3, backend=b).predict_mean(test_x)
            for b in ("dense", "cholesky")
        )
    rounding = relative_error(cholesky, dense)
    assert rounding < 1e-3  # rounding, not a wrong answer
    assert relative_error(got, dense) < model.error_estimate + rounding
    assert relative_error(got, cholesky) < model.error_estimate + rounding


@pytest.mark.parametrize("rtol", [1e-3, 1e-6])
def test_float32_lanczos_meets_a_float32_tolerance_or_names_float64(rtol):
    x, y, test_x = wiggly_data(n=200)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0).float()
    model = DataCentricGPR(
        x.float(),
        y.float(),
        kernel,
        noise=[0.1, 0.2],
        backend="lanczos",
        linalg_dtype=None,
        rtol=rtol,
    )
    with warnings.catch_warnings(record=True) as rec, torch.no_grad():
        warnings.simplefilter("always", NumericalWarning)
        got = model.predict_mean(test_x.float())
    messages = [str(w.message) for w in rec if issubclass(w.category, NumericalWarning)]
    reference = rbf_kernel(outputscale=1.0, lengthscale=1.0)
    with torch.no_grad():
        dense = DataCentricGPR(x, y, reference, noise=[0.1, 0.2], backend="dense").predict_mean(
            test_x
        )
    if rtol == 1e-3:  # within float32's reach: met, silently
        assert messages == [] and model.error_estimate <= rtol
        assert relative_error(got.double(), dense) < rtol
    else:  # beyond it: a warning that names the way out
        assert any("linalg_dtype=torch.float64" in m for m in messages)


def test_cg_long_chain_matches_dense_on_a_hard_spectrum():
    x, y, test_x = wiggly_data()
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.1)
    gammas = torch.full((40,), 1e-2, dtype=DTYPE)
    cg = DataCentricGPR(x, y, kernel, noise=gammas, alpha=0.2, backend="cg", rank=16, rtol=1e-10)
    dense = DataCentricGPR(x, y, kernel, noise=gammas, alpha=0.2, backend="dense")
    with torch.no_grad():
        got, ref = cg.predict_mean(test_x), dense.predict_mean(test_x)
        got_targets, ref_targets = cg.step_targets(), dense.step_targets()
        engine = cg._state()["engine"]
    assert relative_error(got, ref) < 1e-8
    assert relative_error(got_targets, ref_targets) < 1e-8
    assert 0 < engine.krylov_error_estimate <= 1e-10  # the one-run Krylov path served the chain


def float32_problem(n=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=gen)
    y = torch.sin(3 * x).sum(-1) + 0.05 * torch.randn(n, generator=gen)
    return x, y, torch.rand(50, 2, generator=gen)


@pytest.mark.parametrize("backend", ["cholesky", "lanczos", "cg"])
def test_float32_data_every_backend_factors_the_same_float64_kernel_matrix(backend):
    # Before, the dense backends evaluated K in float32 and cast it, the matrix-free ones in
    # float64: their results differed by up to 2e-6 though each met rtol = 1e-6 on its own K.
    x, y, test_x = float32_problem()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    kernel.base_kernel.lengthscale = 0.3
    gammas = [0.01, 0.05]
    with torch.no_grad():
        ref = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense").predict(test_x)
        got = DataCentricGPR(x, y, kernel, noise=gammas, backend=backend, rtol=1e-9).predict(test_x)
    assert got.mean.dtype == torch.float32
    assert relative_error(got.mean, ref.mean) < 2e-7
    assert relative_error(got.variance, ref.variance) < 2e-7


@pytest.mark.parametrize("backend", ["lanczos", "cg"])
def test_matrix_free_backends_take_a_kernel_that_rejects_mixed_dtypes(backend):
    # PolynomialKernel's addmm fails on float64 inputs with float32 parameters; the matrix-free
    # backends used to evaluate it so for float32 data.
    x, y, test_x = float32_problem(n=200)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.PolynomialKernel(power=2))
    with torch.no_grad():
        ref = DataCentricGPR(x, y, kernel, noise=[0.1, 0.2], backend="dense").predict(test_x)
        got = DataCentricGPR(x, y, kernel, noise=[0.1, 0.2], backend=backend).predict(test_x)
    assert relative_error(got.mean, ref.mean) < 1e-5
    assert relative_error(got.variance, ref.variance) < 1e-5


def test_float32_dense_backend_keeps_gradients_to_the_float32_hyperparameters():
    x, y, test_x = float32_problem(n=100)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    model = DataCentricGPR(x, y, kernel, noise=[0.1, 0.2], backend="dense")
    model.predict(test_x).mean.sum().backward()
    grad = kernel.base_kernel.raw_lengthscale.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.abs().sum() > 0


def count_training_evaluations(kernel, n):
    """Wrap ``kernel.forward`` to count its evaluations against all ``n`` training inputs."""
    calls = []
    forward = kernel.forward

    def counting(x1, x2, **kwargs):
        if x2.shape[-2] == n and not kwargs.get("diag", False):
            calls.append(x1.shape[-2])
        return forward(x1, x2, **kwargs)

    kernel.forward = counting
    return calls


@pytest.mark.parametrize("backend", ["cg", "lanczos"])
def test_matrix_free_backends_keep_kernel_rows_between_products(backend):
    """By default the rows of K are evaluated at the first four products (kept from the fourth)
    and read at every later one; with kernel_cache_bytes=0 at every product. The predictions
    agree either way."""
    x, y, test_x = wiggly_data()
    gammas = torch.linspace(1e-2, 0.1, 5, dtype=DTYPE)
    models, evaluations = [], []
    for cache in (None, 0):
        kernel = rbf_kernel(outputscale=1.0, lengthscale=0.3)
        evaluations.append(count_training_evaluations(kernel.base_kernel, 300))
        models.append(
            DataCentricGPR(x, y, kernel, noise=gammas, backend=backend, kernel_cache_bytes=cache)
        )
    dense = DataCentricGPR(x, y, rbf_kernel(outputscale=1.0, lengthscale=0.3), noise=gammas)
    with torch.no_grad():
        kept, fresh, ref = (m.predict(test_x) for m in (*models, dense))
        engine = models[0]._state()["engine"]
    if backend == "cg":
        assert engine.kernel.kept_bytes == 300 * 300 * 8
    products = len(evaluations[1])  # without kept rows: one evaluation per product
    assert products >= 3, evaluations
    assert evaluations[0] == [300] * min(
        products, gpsd.settings.keep_kernel_rows_after.value() + 1
    )  # in one chunk
    if backend == "cg":  # tens of products: all but four read the kept rows
        assert products > 10
    for got in (kept, fresh):
        assert relative_error(got.mean, ref.mean) < 1e-5
        assert relative_error(got.variance, ref.variance) < 1e-5


def test_kernel_cache_bytes_must_be_a_non_negative_integer():
    x, y, _ = wiggly_data(n=20)
    with pytest.raises(ValueError, match="kernel_cache_bytes must be a non-negative integer"):
        DataCentricGPR(x, y, rbf_kernel(), noise=0.1, backend="cg", kernel_cache_bytes=-5)
    for bad in (1.5, True):  # before, True was taken as 1 byte
        with pytest.raises(ValueError, match="kernel_cache_bytes"):
            DistributionCentricGPR(x, y, rbf_kernel(), noise=0.1, kernel_cache_bytes=bad)
    # any integer type, as for the other counts (NumPy's was refused before)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=0.1, kernel_cache_bytes=np.int64(10**6))
    assert model.kernel_cache_bytes == 10**6 and type(model.kernel_cache_bytes) is int


def test_default_kernel_cache_is_half_the_free_memory_less_the_working_set(monkeypatch):
    x = torch.rand(1000, 2, dtype=DTYPE)
    kernel = rbf_kernel()
    working = (8 * 4096 + 4 * 2048) * 1000 * 8  # N-vectors of a prediction, in float64 bytes
    for free, expected in [
        (10 * working, 5 * working),  # plenty: half of it
        (working + 1000, 1000),  # the working set first
        (working // 2, 0),  # not even that: keep nothing
    ]:
        monkeypatch.setattr(
            backend_module, "free_memory_bytes", lambda device, wanted=None, free=free: free
        )
        operator = backend_module._matrix_free(kernel, x, torch.float64, None)
        assert operator.cache_bytes == expected
    assert backend_module._matrix_free(kernel, x, torch.float64, 123).cache_bytes == 123


@pytest.mark.parametrize("backend", ["lanczos", "cg"])
@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_a_batch_of_kernels_on_shared_inputs(cls, backend):
    """A kernel with a batch shape on unbatched training inputs is a batch of kernel matrices for
    the matrix-free backends too; each entry equals its own unbatched dense model."""
    x, y, test_x = wiggly_data(n=200, seed=3)
    lengthscales = [0.8, 2.0] if backend == "lanczos" else [0.2, 0.8]
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0, batch_shape=torch.Size([2]))
    kernel.base_kernel.lengthscale = torch.tensor(lengthscales, dtype=DTYPE).reshape(2, 1, 1)
    gammas = torch.tensor([0.05, 0.1, 0.2], dtype=DTYPE)
    model = cls(x, y, kernel, noise=gammas, backend=backend, rtol=1e-9)
    with torch.no_grad():
        path = model.predict(test_x)
    assert path.mean.shape == (2, 3, 77)
    for b, lengthscale in enumerate(lengthscales):
        single = cls(x, y, rbf_kernel(outputscale=1.0, lengthscale=lengthscale), noise=gammas)
        with torch.no_grad():
            ref = single.predict(test_x)
        assert relative_error(path.mean[b], ref.mean) < 1e-7
        assert relative_error(path.variance[b], ref.variance) < 1e-7


def test_auto_counts_the_matrices_of_a_kernel_batch_on_shared_inputs(monkeypatch):
    """backend='auto' plans memory for every matrix: a kernel batch of 4 on unbatched inputs is 4."""
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["batch_size"])
        return choose(*args, **kwargs)

    choose = backend_module.choose_backend
    monkeypatch.setattr(backend_module, "choose_backend", recording)
    x, y, test_x = wiggly_data(n=60)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0, batch_shape=torch.Size([4]))
    with torch.no_grad():
        DataCentricGPR(x, y, kernel, noise=[0.1, 0.2]).predict(test_x)
        DataCentricGPR(x.expand(4, -1, -1), y.expand(4, -1), kernel, noise=[0.1, 0.2]).predict(
            test_x.expand(4, -1, -1)
        )
    assert seen == [4, 4]


def test_auto_plans_a_factor_of_the_schedules_against_the_kernel_batch(monkeypatch):
    """Schedules of batch (3, 1) against a kernel batch of 2: each factor is 6 matrices."""
    seen = []

    def recording(*args, **kwargs):
        seen.append((kwargs["batch_size"], kwargs["num_schedules"], kwargs["factor_batch_size"]))
        return choose(*args, **kwargs)

    choose = backend_module.choose_backend
    monkeypatch.setattr(backend_module, "choose_backend", recording)
    x, y, test_x = wiggly_data(n=40)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0, batch_shape=torch.Size([2]))
    gamma = torch.tensor([0.1, 0.2, 0.3], dtype=DTYPE).reshape(3, 1, 1).expand(3, 1, 2)
    model = DataCentricGPR(x, y, kernel, noise=gamma, backend="cholesky")
    engine = model._state()["engine"]
    with torch.no_grad():
        DataCentricGPR(x, y, kernel, noise=gamma).predict(test_x)
        factor = engine.factor(gamma[..., 0].contiguous())
    assert seen == [(2, 3, 6)] and factor.shape[:-2].numel() == 6


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_cg_variances_that_a_loose_rtol_leaves_uncertain_are_reported(cls):
    """At noise 1e-8 a residual within rtol = 1e-6 leaves the quadratic form k*^T A^-1 k*
    uncertain by up to |r|^2 / 1e-8, far more than the variances: it said nothing before, with
    variances 14 % (data-centric) and 31 % (distribution-centric) off; the error depends on
    rounding (8 % to 11 % at rank 96 with one or two threads), hence the margin below."""
    kernel, x, y, test_x = matern_regression_problem()
    gamma = torch.tensor([1e-8, 1e-8], dtype=DTYPE)
    exact = cls(x, y, kernel, noise=gamma, backend="cholesky").predict(test_x).variance.detach()
    model = cls(x, y, kernel, noise=gamma, backend="cg", rank=64, rtol=1e-6)
    with pytest.warns(NumericalWarning, match="uncertain by up to"):
        variance = model.predict(test_x).variance.detach()
    assert float(((variance - exact).abs() / exact).max()) > 0.05  # 5e4 times rtol
    assert bool((variance >= exact * (1 - 1e-9)).all())  # the form errs low: variances high
    with warnings.catch_warnings():  # a larger noise: the same rtol is ample
        warnings.simplefilter("error")
        calm = cls(x, y, kernel, noise=gamma * 1e6, backend="cg", rank=64, rtol=1e-6)
        calm.predict(test_x)


@pytest.mark.parametrize("gamma", [[1e-6, 1e-6], [1e-6, 1e-5]])
def test_cg_covariance_diagonals_equal_the_variances(gamma):
    """Before, the covariances took the first-order C^T X: at noise 1e-6 and rtol 1e-6 their
    diagonal was 9.4e-2 off the Cholesky variances where the variances were 3.1e-2 off."""
    kernel, x, y, test_x = matern_regression_problem()
    gamma = torch.tensor(gamma, dtype=DTYPE)
    exact = DataCentricGPR(x, y, kernel, noise=gamma, backend="cholesky").predict(
        test_x, full_cov=True
    )
    model = DataCentricGPR(x, y, kernel, noise=gamma, backend="cg", rank=64, rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)  # rtol is loose here on purpose
        path = model.predict(test_x, full_cov=True)
    diagonal = path.covariance.detach().diagonal(dim1=-2, dim2=-1)
    error = (path.covariance - exact.covariance).detach()
    # the variances and the diagonal both err low in the forms: high, within their bound
    reference = exact.variance.detach()
    assert float(((diagonal - reference).abs() / reference).max()) < 0.05
    if gamma[0] == gamma[1]:  # one shift: the same iterate and residual for both
        assert torch.allclose(diagonal, path.variance, rtol=1e-9, atol=0)
    assert float(torch.linalg.eigvalsh(error).min()) >= -1e-12


def test_the_uncertain_variance_warning_points_at_the_caller_across_chunks(use_setting):
    """With the test points in several chunks, the warning points at the caller (a list
    comprehension in predict would make it point inside gpsd on Python 3.11)."""
    use_setting(gpsd.settings.test_chunk_size(3))
    kernel, x, y, test_x = matern_regression_problem()
    model = DataCentricGPR(x, y, kernel, noise=[1e-8], backend="cg", rank=64, rtol=1e-6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = model.predict(test_x)  # 8 points: chunks of 3, 3 and 2
    assert path.variance.shape == (1, 8)
    uncertain = [w for w in caught if "uncertain" in str(w.message)]
    assert uncertain and all(w.filename == __file__ for w in uncertain)
