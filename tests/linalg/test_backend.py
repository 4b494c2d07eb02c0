"""Tests of the backend policy: choose_backend, make_engine (its fallbacks, the memory check
before dense requests, progress), and the engines it gives the regression distillers."""

import warnings

import gpytorch
import pytest
import torch
from gpr_reference import rbf_kernel
from gpytorch.utils.warnings import NumericalWarning

import gpsd
import gpsd.linalg
import gpsd.linalg.backend as backend_module
from gpsd import DataCentricGPR
from gpsd.linalg import KernelSpectrum, ShiftedCG, ShiftedCholesky, choose_backend, make_engine

DTYPE = torch.float64


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
    # without factor_batch_size, a factor holds max(2, 3) = 3 matrices: 2 + 3 + 2 * 12 = 29
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


def _repeated_inputs(distinct=20, copies=15, seed=0):
    """``distinct`` points repeated ``copies`` times: an RBF kernel of rank ``distinct``."""
    gen = torch.Generator().manual_seed(seed)
    return (10 * torch.rand(distinct, 1, generator=gen, dtype=DTYPE)).repeat(copies, 1)


@pytest.mark.parametrize("backend,rank", [("lanczos", 64), ("lanczos", None), ("cg", 64)])
def test_repeated_inputs_predict_as_the_dense_backend_does(backend, rank):
    # rank 64 on a kernel of rank 25: the Krylov space becomes invariant; a basis that lost
    # orthogonality there would make Lanczos' series diverge and stall deflated CG at 0.01
    x = _repeated_inputs(25, 12)
    gen = torch.Generator().manual_seed(2)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(x.shape[0], generator=gen, dtype=DTYPE)
    test_x = torch.linspace(0, 10, 9, dtype=DTYPE).unsqueeze(-1)
    gammas = [0.1, 0.2]
    with torch.no_grad():
        expected = DataCentricGPR(x, y, rbf_kernel(), noise=gammas, backend="dense").predict(test_x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = DataCentricGPR(x, y, rbf_kernel(), noise=gammas, backend=backend, rank=rank).predict(
            test_x
        )
        mean, variance = got.mean.detach(), got.variance.detach()
    assert float((mean - expected.mean).norm() / expected.mean.norm()) < 1e-9
    assert float((variance - expected.variance).abs().max() / expected.variance.max()) < 1e-8


def test_data_centric_lanczos_at_fifteen_inputs_equals_the_dense_path():
    x = torch.linspace(0, 10, 15, dtype=DTYPE).unsqueeze(-1)
    y = torch.sin(x).squeeze(-1)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    noise = torch.linspace(0.1, 1.0, 5, dtype=DTYPE)
    test_x = torch.linspace(-1, 11, 7, dtype=DTYPE).unsqueeze(-1)
    with torch.no_grad():
        got = DataCentricGPR(x, y, kernel, noise=noise, backend="lanczos").predict(test_x)
        ref = DataCentricGPR(x, y, kernel, noise=noise, backend="dense").predict(test_x)
    torch.testing.assert_close(got.mean, ref.mean, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.variance, ref.variance, rtol=1e-9, atol=1e-12)


def _kernel(lengthscale=1.0):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    k.base_kernel.lengthscale = lengthscale
    return k


def _data(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DTYPE)
    return x, torch.sin(x.squeeze(-1)) + 0.1 * torch.randn(n, generator=gen, dtype=DTYPE)


def test_a_tight_rtol_on_a_smooth_kernel_is_met_not_refused():
    x, y = _data(600)
    test_x = torch.linspace(0, 10, 50, dtype=DTYPE).unsqueeze(-1)
    noise = torch.tensor([1e-4, 1e-3], dtype=DTYPE)
    with torch.no_grad():
        model = DataCentricGPR(x, y, _kernel(), noise=noise, backend="lanczos", rtol=1e-8)
        got = model.predict_mean(test_x)
        dense = DataCentricGPR(x, y, _kernel(), noise=noise, backend="dense").predict_mean(test_x)
    assert model.error_estimate <= 1e-8
    scale = dense.abs().max()
    assert float((got - dense).abs().max() / scale) < 1e-8


def test_switching_the_grad_mode_keeps_a_matrix_free_engine():
    x, y = _data(300)
    model = DataCentricGPR(x, y, _kernel(0.3), noise=[0.01, 0.02], backend="cg", rtol=1e-6)
    with torch.no_grad():
        first = model.predict_mean(x[:5])
    engine = model._state()["engine"]
    second = model.predict_mean(x[:5])  # gradients enabled now
    assert model._state()["engine"] is engine
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    with pytest.raises(gpsd.BackendError, match="'dense' or 'cholesky'"):
        second.sum().backward()  # CG builds no graph
    # a dense engine carries a graph with gradients enabled: rebuilt
    dense = DataCentricGPR(x, y, _kernel(0.3), noise=[0.01, 0.02], backend="dense")
    with torch.no_grad():
        dense.predict_mean(x[:5])
        engine = dense._state()["engine"]
    assert dense.predict_mean(x[:5]).requires_grad and dense._state()["engine"] is not engine


def test_the_low_precision_warning_comes_before_the_factorisation(monkeypatch):
    def failing_engine(*args, **kwargs):
        raise RuntimeError("the factorisation failed")

    monkeypatch.setattr(gpsd.linalg, "make_engine", failing_engine)
    x, y = _data(40)
    kernel = gpytorch.kernels.RBFKernel()
    model = DataCentricGPR(x.float(), y.float(), kernel, noise=[1e-6], linalg_dtype=None)
    with (
        pytest.warns(NumericalWarning, match="factored in torch.float32"),
        pytest.raises(RuntimeError, match="the factorisation failed"),
        torch.no_grad(),
    ):
        model.predict_mean(x[:3].float())


def test_a_float32_lanczos_spectrum_warns_instead_of_refusing():
    # every pair's residual is at float32 rounding: the rounding floor counts them as resolved
    x, y = _data(300)
    test_x = torch.linspace(0, 10, 20, dtype=DTYPE).unsqueeze(-1)
    model = DataCentricGPR(
        x.float(), y.float(), _kernel().float(), noise=[1e-2], backend="lanczos", linalg_dtype=None
    )
    with torch.no_grad(), pytest.warns(NumericalWarning, match="estimated relative error"):
        got = model.predict_mean(test_x.float())
    with torch.no_grad():
        dense = DataCentricGPR(x, y, _kernel(), noise=[1e-2], backend="dense").predict_mean(test_x)
    error = float((got.double() - dense).abs().max() / dense.abs().max())
    assert error < 10 * model.error_estimate and model.error_estimate < 0.05


def test_auto_rebuilds_for_gradients_after_a_no_grad_prediction():
    # under no_grad, auto may take a truncated Lanczos spectrum (no graph); a later prediction
    # with gradients must not reuse it
    x, y = _data(300)
    gammas = torch.full((30,), 0.1, dtype=DTYPE)
    model = DataCentricGPR(x, y, _kernel(2.0), noise=gammas)
    with torch.no_grad():
        model.predict_mean(x[:5])
    mean = model.predict_mean(x[:5])
    assert mean.requires_grad
    (got,) = torch.autograd.grad(mean.sum(), model.covar_module.base_kernel.raw_lengthscale)
    fresh = DataCentricGPR(x, y, _kernel(2.0), noise=gammas)
    (expected,) = torch.autograd.grad(
        fresh.predict_mean(x[:5]).sum(), fresh.covar_module.base_kernel.raw_lengthscale
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)


def test_cg_splits_off_only_pairs_within_the_residual_tolerance():
    # the rounding floor that lets Lanczos count pairs as resolved is not for CG, whose
    # estimate ignores the split-off pairs' residuals: float32 chains would come out 1.4 off
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(300, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(x.squeeze(-1)) + 0.1 * torch.randn(300, generator=gen, dtype=DTYPE)
    test_x = torch.linspace(0, 10, 40, dtype=DTYPE).unsqueeze(-1)
    gammas = torch.logspace(0, 1, 20, dtype=DTYPE) * 1e-4

    def kernel(dtype):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).to(DTYPE)
        return k.to(dtype)

    with torch.no_grad():
        dense = DataCentricGPR(x, y, kernel(DTYPE), noise=gammas, backend="dense").predict_mean(
            test_x
        )
        model = DataCentricGPR(
            x.float(),
            y.float(),
            kernel(torch.float32),
            noise=gammas.float(),
            backend="cg",
            linalg_dtype=None,
            rtol=1e-3,
        )
        with pytest.warns(NumericalWarning):  # the float32 warning
            got = model.predict_mean(test_x.float())
    engine = model._state()["engine"]
    error = (got.double() - dense).abs().amax(-1) / dense.abs().amax(-1)
    assert float(error.max()) < 0.05
    assert int(engine.resolved.sum()) == 0  # none within residual_tol in float32 here


# ------------------------------------------------------------------ make_engine
def _make(kernel, x, backend, **kwargs):
    """make_engine as the regression distillers call it: one schedule of two steps."""
    options = dict(
        schedule_shape=torch.Size(),
        num_steps=2,
        eig_dtype=torch.float64,
        rank=None,
        generator_seed=0,
        gamma_min=1e-2,
        rtol=1e-8,
    )
    options.update(kwargs)
    return make_engine(kernel, x, backend, **options)


class _CountingRBF(gpytorch.kernels.RBFKernel):
    """An RBF kernel that counts its evaluations."""

    evaluations = 0

    def forward(self, x1, x2, **params):
        type(self).evaluations += 1
        return super().forward(x1, x2, **params)


@pytest.mark.parametrize(
    "backend, matrices",
    [("dense", 4), ("cholesky", 3)],  # eigh: K, eigenvectors, workspace; chain: K, K + g I, L
)
def test_a_dense_request_that_cannot_fit_fails_before_evaluating_the_kernel(
    monkeypatch, backend, matrices
):
    n = 200
    x = torch.rand(n, 1, dtype=DTYPE)
    needed = matrices * n * n * 8
    monkeypatch.setattr(backend_module, "free_memory_bytes", lambda device, wanted=None: needed - 1)
    kernel = _CountingRBF().to(DTYPE)
    _CountingRBF.evaluations = 0
    with pytest.raises(gpsd.InsufficientMemoryError) as caught:
        _make(kernel, x, backend)
    message = str(caught.value)
    assert f"backend='{backend}' needs about {needed} bytes" in message
    assert f"but {needed - 1} bytes" in message
    assert "backend='lanczos' or backend='cg'" in message
    assert isinstance(caught.value, MemoryError) and _CountingRBF.evaluations == 0
    # exactly enough: it goes ahead
    monkeypatch.setattr(backend_module, "free_memory_bytes", lambda device, wanted=None: needed)
    assert isinstance(_make(kernel, x, backend), (KernelSpectrum, ShiftedCholesky))


def test_the_memory_check_counts_the_schedules_and_the_kernels_batch():
    # a batch of 3 kernel matrices and 2 schedules each: 3 matrices, then factors of (2, 3)
    n = 50
    x = torch.rand(3, n, 1, dtype=DTYPE)
    seen = []

    def free(device, wanted=None):
        seen.append(wanted)
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend_module, "free_memory_bytes", free)
        with pytest.raises(gpsd.InsufficientMemoryError):
            _make(
                gpytorch.kernels.RBFKernel().to(DTYPE),
                x,
                "cholesky",
                schedule_shape=torch.Size([2, 1]),
            )
        with pytest.raises(gpsd.InsufficientMemoryError):
            _make(gpytorch.kernels.RBFKernel().to(DTYPE), x, "dense")
    one = n * n * 8
    assert seen == [3 * one + 2 * 6 * one, 4 * 3 * one]


def test_matrix_free_backends_and_auto_are_not_held_to_the_dense_memory(monkeypatch):
    x = torch.linspace(0, 10, 80, dtype=DTYPE).unsqueeze(-1)
    monkeypatch.setattr(backend_module, "free_memory_bytes", lambda device, wanted=None: 2**16)
    kernel = rbf_kernel()
    with torch.no_grad():
        for backend in ("lanczos", "cg", "auto"):
            engine = _make(kernel, x, backend, kernel_cache_bytes=0)
            assert engine.matrix_free, backend


def test_make_engine_reports_the_growth_of_lanczos_and_a_callback_stops_it():
    x = torch.linspace(0, 10, 300, dtype=DTYPE).unsqueeze(-1)
    kernel = rbf_kernel()
    records = []
    with torch.no_grad():
        engine = _make(kernel, x, "lanczos", callback=records.append)
        assert records and records[-1].info["rank"] == engine.ritz_values.shape[-1]
        assert records[-1].info["error_estimate"] <= 1e-8 or engine.meets(1e-2, 1e-8)
        assert [r.iteration for r in records] == list(range(1, len(records) + 1))
        silent = _make(kernel, x, "lanczos")
    torch.testing.assert_close(engine.eigenvalues, silent.eigenvalues, rtol=0, atol=0)


def test_auto_stopped_by_the_callback_goes_on_as_where_lanczos_falls_short(use_setting):
    use_setting(gpsd.settings.dense_max_n(cpu=16))  # N = 300 is beyond dense: Lanczos then CG
    x = torch.linspace(0, 10, 300, dtype=DTYPE).unsqueeze(-1)
    records = []

    def stop_at_once(record):
        records.append(record)
        return True

    with torch.no_grad():
        engine = _make(_kernel(0.2), x, "auto", callback=stop_at_once)
    assert len(records) == 1
    assert isinstance(engine, ShiftedCG) and engine.ritz_values.shape[-1] == records[0].info["rank"]


def test_the_engines_of_make_engine_say_whether_they_are_matrix_free():
    x = torch.linspace(0, 10, 100, dtype=DTYPE).unsqueeze(-1)
    kernel = rbf_kernel()
    with torch.no_grad():
        engines = {b: _make(kernel, x, b) for b in ("dense", "cholesky", "lanczos", "cg")}
        # auto within the dense size, without a graph: Lanczos on the formed matrix
        auto = _make(kernel, x, "auto", num_steps=20)
    assert {b: e.matrix_free for b, e in engines.items()} == {
        "dense": False,
        "cholesky": False,
        "lanczos": True,
        "cg": True,
    }
    assert isinstance(auto, KernelSpectrum) and auto.is_truncated and not auto.matrix_free
