"""Tests of the backend policy: choose_backend, make_engine (auto's choices, its fallbacks, the
memory check before dense requests, progress), and the engines it gives the regression
distillers, through make_engine and through a distiller."""

import warnings

import gpytorch
import numpy as np
import pytest
import torch
from gpr_reference import rbf_kernel, relative_error, wiggly_data
from gpytorch.utils.warnings import NumericalWarning

import gpsd
import gpsd.linalg
import gpsd.linalg.backend as backend_module
from gpsd import DataCentricGPR
from gpsd.data import xsinx_regression
from gpsd.linalg import (
    EngineRequest,
    KernelSpectrum,
    ShiftedCG,
    ShiftedCholesky,
    choose_backend,
    make_engine,
)

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


# ------------------------------------------------------------------ make_engine
def _make(kernel, x, backend, progress=False, callback=None, **fields):
    """make_engine as the regression distillers call it: one schedule of two steps."""
    options = dict(
        schedule_shape=torch.Size(),
        steps=2,
        dtype=torch.float64,
        rank=None,
        rtol=1e-8,
        smallest_noise=1e-2,
    )
    options.update(fields)
    request = EngineRequest(kernel, x, backend, **options)
    return make_engine(request, progress=progress, callback=callback)


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
    use_setting, backend, matrices
):
    n = 200
    x = torch.rand(n, 1, dtype=DTYPE)
    needed = matrices * n * n * 8
    use_setting(gpsd.settings.memory_limit(cpu=needed - 1))
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
    use_setting(gpsd.settings.memory_limit(cpu=needed))
    assert isinstance(_make(kernel, x, backend), (KernelSpectrum, ShiftedCholesky))


def test_the_free_bytes_of_a_request_replace_the_measured_memory():
    n = 80
    x = torch.linspace(0, 10, n, dtype=DTYPE).unsqueeze(-1)
    kernel = rbf_kernel()
    needed = 4 * n * n * 8  # eigh: K, eigenvectors, workspace
    with pytest.raises(gpsd.InsufficientMemoryError, match=f"but {needed - 1} bytes"):
        _make(kernel, x, "dense", free_bytes=needed - 1)
    assert _make(kernel, x, "dense", free_bytes=needed).name == "dense"
    with gpsd.settings.memory_limit(0):  # the request's bytes are not capped by the setting
        assert _make(kernel, x, "dense", free_bytes=needed).name == "dense"
    with torch.no_grad():  # too little for the chain or eigh: auto goes matrix-free
        assert _make(kernel, x, "auto", free_bytes=needed - 1, cache_bytes=0).matrix_free
        assert not _make(kernel, x, "auto", free_bytes=2**40).matrix_free


def test_the_memory_check_counts_the_schedules_and_the_kernels_batch():
    # a batch of 3 kernel matrices and 2 schedules each: 3 matrices, then factors of (2, 3)
    n = 50
    x = torch.rand(3, n, 1, dtype=DTYPE)
    one = n * n * 8
    with gpsd.settings.memory_limit(0):
        with pytest.raises(
            gpsd.InsufficientMemoryError, match=f"needs about {3 * one + 2 * 6 * one} bytes"
        ):
            _make(
                gpytorch.kernels.RBFKernel().to(DTYPE),
                x,
                "cholesky",
                schedule_shape=torch.Size([2, 1]),
            )
        with pytest.raises(gpsd.InsufficientMemoryError, match=f"needs about {4 * 3 * one} bytes"):
            _make(gpytorch.kernels.RBFKernel().to(DTYPE), x, "dense")


def test_matrix_free_backends_and_auto_are_not_held_to_the_dense_memory(use_setting):
    x = torch.linspace(0, 10, 80, dtype=DTYPE).unsqueeze(-1)
    use_setting(gpsd.settings.memory_limit(cpu=2**16))
    kernel = rbf_kernel()
    with torch.no_grad():
        for backend in ("lanczos", "cg", "auto"):
            engine = _make(kernel, x, backend, cache_bytes=0)
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
        engine = _make(
            rbf_kernel(outputscale=1.0, lengthscale=0.2), x, "auto", callback=stop_at_once
        )
    assert len(records) == 1
    assert isinstance(engine, ShiftedCG) and engine.ritz_values.shape[-1] == records[0].info["rank"]


def test_a_forced_lanczos_stopped_by_the_callback_says_so_in_its_accuracy_check():
    x = torch.linspace(0, 10, 300, dtype=DTYPE).unsqueeze(-1)
    with torch.no_grad():
        engine = _make(rbf_kernel(lengthscale=0.2), x, "lanczos", callback=lambda r: True)
    with pytest.raises(ValueError, match="callback stopped the Lanczos growth") as raised:
        engine.check_accuracy(1e-2, 1e-8)  # as the regression distillers check it
    assert "rank=" not in str(raised.value)


def test_the_engines_of_make_engine_say_whether_they_are_matrix_free():
    x = torch.linspace(0, 10, 100, dtype=DTYPE).unsqueeze(-1)
    kernel = rbf_kernel()
    with torch.no_grad():
        engines = {b: _make(kernel, x, b) for b in ("dense", "cholesky", "lanczos", "cg")}
        # auto within the dense size, without a graph: Lanczos on the formed matrix
        auto = _make(kernel, x, "auto", steps=20)
    assert {b: e.matrix_free for b, e in engines.items()} == {
        "dense": False,
        "cholesky": False,
        "lanczos": True,
        "cg": True,
    }
    assert isinstance(auto, KernelSpectrum) and auto.is_truncated and not auto.matrix_free


def test_the_dense_backend_without_a_graph_keeps_its_eigenvectors_factored():
    """On the CPU, without an autograd graph to keep, the dense backend diagonalises through the
    tridiagonal reduction; with one, through torch.linalg.eigh, whose graph reaches the kernel."""
    x = torch.linspace(0, 10, 80, dtype=DTYPE).unsqueeze(-1)
    kernel = rbf_kernel()
    with torch.no_grad():
        plain = _make(kernel, x, "dense")
    graph = _make(kernel, x, "dense")
    assert not plain.supports_autograd and graph.supports_autograd
    torch.testing.assert_close(plain.eigenvalues, graph.eigenvalues.detach(), rtol=0, atol=1e-12)


def test_a_failed_tridiagonal_eigensolver_falls_back_to_eigh(monkeypatch):
    def failing(*args, **kwargs):
        raise np.linalg.LinAlgError("stevd did not converge")

    monkeypatch.setattr(KernelSpectrum, "from_tridiagonal", failing)
    x = torch.linspace(0, 10, 50, dtype=DTYPE).unsqueeze(-1)
    with torch.no_grad():
        engine = _make(rbf_kernel(), x, "dense")
    assert isinstance(engine, KernelSpectrum) and engine.supports_autograd  # eigh's spectrum


def _flat_problem(n=400):
    """3-D inputs at lengthscale 1: hundreds of eigenvalues above the filters' level."""
    gen = torch.Generator().manual_seed(11)
    return 10 * torch.rand(n, 3, generator=gen, dtype=DTYPE)


@pytest.mark.parametrize("backend", ["lanczos", "cg"])
def test_a_forced_matrix_free_backend_on_a_flat_spectrum_warns_before_it_runs(backend, monkeypatch):
    """The warning comes before the first Lanczos product, names the eigenvalue count, the
    estimated cost and backend='auto'; a smooth 1-D kernel gets none."""
    events = []
    from_lanczos = KernelSpectrum.from_lanczos.__func__

    def recording(cls, *args, **kwargs):
        events.append("lanczos")
        return from_lanczos(cls, *args, **kwargs)

    monkeypatch.setattr(KernelSpectrum, "from_lanczos", classmethod(recording))
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _make(kernel, _flat_problem(), backend, rank=16, smallest_noise=0.1, rtol=1e-6)
    hard = [w for w in caught if "slowly decaying spectrum" in str(w.message)]
    assert len(hard) == 1 and issubclass(hard[0].category, NumericalWarning)
    message = str(hard[0].message)
    assert "eigenvalues above" in message and "backend='auto'" in message
    assert ("Krylov columns" if backend == "lanczos" else "CG solves") in message
    assert events == ["lanczos"]
    smooth = torch.linspace(0, 10, 400, dtype=DTYPE).unsqueeze(-1)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _make(kernel, smooth, backend, rank=16, smallest_noise=0.1, rtol=1e-6)
    assert not [w for w in caught if "slowly decaying spectrum" in str(w.message)]


def test_a_flat_spectrum_under_a_few_large_eigenvalues_warns_before_a_forced_cg():
    """Gaussian inputs in 48 dimensions at lengthscale 6: a few large eigenvalues and every
    other one above the filters' level. The count on the whole matrix finds 12 eigenvalues;
    with the leading part of the range taken out first it finds more than a quarter of N."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(400, 48, generator=gen, dtype=DTYPE)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=6.0)
    dense = kernel(x).to_dense().detach()
    tau = backend_module._lanczos_threshold(0.1, 1e-6)
    assert int((torch.linalg.eigvalsh(dense) > tau).sum()) == 400
    whole = backend_module._eigenvalue_count_bound(dense.trace(), dense.square().sum(), 400, tau)
    assert float(whole) < 400 // 4 / backend_module._COLUMNS_PER_PAIR  # the old count: silent
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _make(kernel, x, "cg", rank=16, smallest_noise=0.1, rtol=1e-6)
    hard = [w for w in caught if "slowly decaying spectrum" in str(w.message)]
    assert len(hard) == 1 and "CG solves" in str(hard[0].message)


def _deflation_warnings(kernel, x, monkeypatch, **kwargs):
    """The flat-spectrum warnings of a forced ``cg`` whose probes count short (the probe check
    made silent), and the spectrum it deflates."""
    monkeypatch.setattr(backend_module, "_warn_if_hard_for_matrix_free", lambda *a, **k: False)
    seen = {}
    from_spectrum = ShiftedCG.from_spectrum.__func__

    def recording(cls, operator, spectrum, **options):
        seen["spectrum"] = spectrum
        return from_spectrum(cls, operator, spectrum, **options)

    monkeypatch.setattr(ShiftedCG, "from_spectrum", classmethod(recording))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _make(kernel, x, "cg", **kwargs)
    hard = [w for w in caught if "slowly decaying spectrum" in str(w.message)]
    return hard, seen["spectrum"]


def test_a_forced_cg_warns_after_its_lanczos_run_where_the_deflated_rest_is_not_small(
    monkeypatch,
):
    """Where the probes count short, the Ritz values of the deflating run still show the rest
    of the spectrum: its mean eigenvalue, the trace of P⊥ K P⊥ over N - k formed densely from
    the Ritz vectors, is named in the warning and is at least the smallest noise."""
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0)
    x = _flat_problem()
    hard, spectrum = _deflation_warnings(kernel, x, monkeypatch, smallest_noise=0.1)
    assert len(hard) == 1 and issubclass(hard[0].category, NumericalWarning)
    message = str(hard[0].message)
    k = spectrum.ritz_vectors.shape[-1]
    assert k == 256 and "after deflating 256 Ritz pairs" in message
    assert "backend='auto'" in message
    complement = torch.eye(400, dtype=DTYPE) - spectrum.ritz_vectors @ spectrum.ritz_vectors.mT
    dense = kernel(x).to_dense().detach()
    mean = float((complement @ dense @ complement).trace() / (400 - k))
    assert mean >= 0.1 and f"average {mean:.3g}," in message
    smooth = torch.linspace(0, 10, 400, dtype=DTYPE).unsqueeze(-1)
    hard, _ = _deflation_warnings(kernel, smooth, monkeypatch, smallest_noise=0.1)
    assert not hard
    hard, _ = _deflation_warnings(kernel, x, monkeypatch, rank=16, smallest_noise=0.1)
    assert not hard  # a rank the caller chose


def test_a_forced_cg_on_3d_inputs_at_n_2000_warns_where_the_probes_alone_are_silent():
    """The 3-D setting of the hard-spectrum benchmark (inputs uniform on [0, 10]^3,
    lengthscale 1): about 1300 eigenvalues above the filters' level, which the two probe
    products count as fewer than N / 8.8; the deflating run's rest averages 0.22."""
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(2000, 3, generator=gen, dtype=DTYPE)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _make(kernel, x, "cg", smallest_noise=0.1, rtol=1e-6)
    hard = [str(w.message) for w in caught if "slowly decaying spectrum" in str(w.message)]
    assert len(hard) == 1 and "after deflating 256 Ritz pairs" in hard[0]


def test_no_flat_spectrum_warning_where_the_dense_matrix_would_not_fit(monkeypatch):
    """Beyond the memory of a dense factorisation the matrix-free backends are the only way:
    nothing better to point to, no warning (and no probe product)."""
    monkeypatch.setattr(backend_module, "choose_backend", lambda *args, **kwargs: "lanczos")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _make(rbf_kernel(lengthscale=1.0), _flat_problem(), "lanczos", rank=16, smallest_noise=0.1)
    assert not [w for w in caught if "slowly decaying spectrum" in str(w.message)]


def test_forms_kernel_matrix_follows_the_backend_and_autos_choice(use_setting):
    x = torch.rand(2, 100, 1, dtype=DTYPE)  # a batch of two 100 x 100 matrices
    kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
    forms = backend_module.forms_kernel_matrix
    assert forms("dense", x, kernel, DTYPE) and forms("cholesky", x, kernel, DTYPE)
    assert not forms("lanczos", x, kernel, DTYPE) and not forms("cg", x, kernel, DTYPE)
    assert forms("auto", x, kernel, DTYPE)  # the chain of one factorisation
    with gpsd.settings.dense_max_n(cpu=49):  # beyond the chain's 2 x 49 and eigh's 49
        assert not forms("auto", x, kernel, DTYPE)
    # the chain of one factor takes the matrices, two factors and one more: 4 matrices for one
    # kernel matrix, 8 for the batch of two (whose eigh, 8 matrices, does not fit either)
    with gpsd.settings.memory_limit(cpu=4 * 100 * 100 * 8):
        assert not forms("auto", x, kernel, DTYPE)
        assert forms("auto", x[0], kernel, DTYPE)
    with gpsd.settings.memory_limit(cpu=4 * 100 * 100 * 8 - 1):
        assert not forms("auto", x[0], kernel, DTYPE)


# ------------ The policy as the regression distillers meet it: auto's choices, its fallbacks, memory


def test_out_of_memory_names_the_backend_to_use(monkeypatch):
    x, y = xsinx_regression(n=40, seed=1)
    x, test_x = x.unsqueeze(-1), torch.linspace(-1.0, 11.0, 23, dtype=DTYPE).unsqueeze(-1)

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(torch.linalg, "eigh", no_memory)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1] * 50, backend="dense")
    with pytest.raises(MemoryError, match="backend='lanczos'"):
        model.predict(test_x)


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
        assert isinstance(auto._current_fit().engine, ShiftedCG)
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
        engine = auto._current_fit().engine
    assert isinstance(engine, KernelSpectrum) and engine.is_truncated


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
    attempt before the dense eigendecomposition stops at half its rank budget of N / 4 (with
    the bound that skips the attempt before any product switched off)."""
    monkeypatch.setattr(backend_module, "_hard_spectrum", lambda *args: False)
    monkeypatch.setattr(backend_module, "_too_many_above", lambda *args: False)
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
        engine = auto._current_fit().engine
    assert isinstance(engine, KernelSpectrum) and not engine.is_truncated  # fell back to eigh
    assert len(runs) == 1
    budget, columns = runs[0]
    assert budget == 150
    assert budget / 2 <= columns < budget  # stopped at the first checkpoint past half
    assert relative_error(got.mean, ref.mean) < 1e-12
    assert relative_error(got.variance, ref.variance) < 1e-12


def _lanczos_runs(monkeypatch) -> list:
    """Record the rank of every KernelSpectrum.from_lanczos call."""
    runs = []
    from_lanczos = KernelSpectrum.from_lanczos.__func__

    def recording(cls, *args, **kwargs):
        runs.append(kwargs["rank"])
        return from_lanczos(cls, *args, **kwargs)

    monkeypatch.setattr(KernelSpectrum, "from_lanczos", classmethod(recording))
    return runs


@pytest.mark.parametrize(("dim", "lengthscale", "tries_lanczos"), [(1, 1.0, True), (3, 1.0, False)])
def test_auto_tries_lanczos_only_where_the_spectrum_may_allow_it(
    monkeypatch, dim, lengthscale, tries_lanczos
):
    """Smooth 1-D inputs: Lanczos is tried (and succeeds); 3-D inputs at lengthscale 1 have
    hundreds of eigenvalues above the level the filters need, which the trace and Frobenius
    norm show before any product: no attempt, the full decomposition straight away."""
    runs = _lanczos_runs(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    x = 10 * torch.rand(600, dim, generator=gen, dtype=DTYPE)
    y = torch.sin(x).sum(-1) + 0.1 * torch.randn(600, generator=gen, dtype=DTYPE)
    test_x = 10 * torch.rand(30, dim, generator=gen, dtype=DTYPE)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=lengthscale)
    gammas = torch.linspace(0.1, 1.0, 10, dtype=DTYPE)
    with torch.no_grad():
        auto = DataCentricGPR(x, y, kernel, noise=gammas)
        got = auto.predict(test_x)
        engine = auto._current_fit().engine
    assert bool(runs) is tries_lanczos
    assert engine.is_truncated is tries_lanczos
    ref = DataCentricGPR(x, y, kernel, noise=gammas, backend="cholesky")  # shifted solves
    with torch.no_grad():
        ref = ref.predict(test_x)
    assert relative_error(got.mean, ref.mean) < 1e-7
    assert relative_error(got.variance, ref.variance) < 1e-7


def test_eigenvalue_count_bound_never_exceeds_the_count():
    """(tr K - N tau)^2 / ||K||_F^2 is a lower bound on #{eigenvalues > tau}: checked against
    the eigenvalues of kernel matrices from flat to steep spectra."""
    gen = torch.Generator().manual_seed(7)
    for dim, lengthscale in ((1, 2.0), (2, 0.5), (3, 1.0), (5, 0.3)):
        x = 10 * torch.rand(300, dim, generator=gen, dtype=DTYPE)
        k = rbf_kernel(outputscale=1.0, lengthscale=lengthscale)(x).to_dense().detach()
        evals = torch.linalg.eigvalsh(k)
        for tau in (1e-3, 1e-1, 1.0):
            bound = backend_module._eigenvalue_count_bound(k.trace(), k.square().sum(), 300, tau)
            assert float(bound) <= int((evals > tau).sum())


def test_a_flat_spectrum_under_one_large_eigenvalue_is_seen_once_it_is_taken_out():
    """Inputs in many dimensions: one eigenvalue near N times the mean kernel value, the rest
    near each other. The count bound on the whole matrix misses it (no skip before the attempt);
    with the large one taken out (as the attempt's Ritz values do), the rest count more
    eigenvalues above the level than the budget can hold, as they are; a smooth kernel's don't."""
    gen = torch.Generator().manual_seed(12)
    n = 400
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DTYPE))
    evals = torch.cat(
        [
            torch.tensor([150.0], dtype=DTYPE),
            0.5 + 0.1 * torch.rand(n - 1, generator=gen, dtype=DTYPE),
        ]
    )
    k = q @ torch.diag(evals) @ q.T
    trace, frobenius_sq = backend_module._trace_and_frobenius(k)
    tau = backend_module._lanczos_threshold(0.1, 1e-6)
    whole = backend_module._eigenvalue_count_bound(trace, frobenius_sq, n, tau)
    assert 3 * float(whole) < 100  # the whole-matrix bound would let Lanczos try
    top = evals[:1]
    assert backend_module._too_many_above(top, trace, frobenius_sq, n, 0.1, 1e-6, 100)
    assert int((evals > tau).sum()) == n  # the truth: every eigenvalue is above the level
    assert not backend_module._hard_spectrum(trace, frobenius_sq, n, 100, 0.1, 1e-6)
    smooth = (
        rbf_kernel(outputscale=1.0, lengthscale=1.0)(
            torch.linspace(0, 10, n, dtype=DTYPE).unsqueeze(-1)
        )
        .to_dense()
        .detach()
    )
    moments = backend_module._trace_and_frobenius(smooth)
    evals = torch.linalg.eigvalsh(smooth).flip(0)
    assert not backend_module._too_many_above(evals[:8], *moments, n, 0.1, 1e-6, 100)


def test_out_of_reach_only_past_half_the_budget_and_only_above_the_threshold():
    gen = torch.Generator().manual_seed(5)
    x = 10 * torch.rand(300, 1, generator=gen, dtype=DTYPE)
    smooth = rbf_kernel(outputscale=1.0, lengthscale=1.0)(x).to_dense()
    rough = rbf_kernel(outputscale=1.0, lengthscale=0.01)(x).to_dense()
    for k, hopeless in ((smooth, False), (rough, True)):
        spectrum = KernelSpectrum.from_lanczos(k, rank=64, residual_tol=1e-8)
        assert backend_module._out_of_reach(spectrum, 128, 0.1, 1e-6) is hopeless
        assert backend_module._out_of_reach(spectrum, 129, 0.1, 1e-6) is False  # 64 < 129 / 2


def test_auto_goes_matrix_free_when_the_dense_matrix_would_not_fit(use_setting):
    x, y, test_x = wiggly_data()  # one 300 x 300 float64 matrix: 0.7 MiB
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.1)
    gammas = torch.full((3,), 1e-2, dtype=DTYPE)  # few steps: the Cholesky chain if it fitted
    with torch.no_grad():  # the reference, with the memory there is
        ref = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense").predict(test_x)
    one_mib = 2**20
    use_setting(gpsd.settings.memory_limit(cpu=one_mib))
    use_setting(gpsd.settings.max_lanczos_rank(32))
    auto = DataCentricGPR(x, y, kernel, noise=gammas, rtol=1e-10)
    with torch.no_grad():
        got = auto.predict(test_x)
        assert isinstance(auto._current_fit().engine, ShiftedCG)
    assert relative_error(got.mean, ref.mean) < 1e-7
    assert relative_error(got.variance, ref.variance) < 1e-7


def test_cg_out_of_memory_names_the_way_out(monkeypatch):
    x, _, _ = wiggly_data(n=100)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(KernelSpectrum, "from_lanczos", out_of_memory)
    model = DataCentricGPR(x, x[:, 0], rbf_kernel(), noise=[0.1], backend="cg", rank=8)
    with torch.no_grad(), pytest.raises(MemoryError, match="smaller rank="):
        model.predict(x[:5])


def test_default_kernel_cache_is_half_the_free_memory_less_the_working_set():
    x = torch.rand(1000, 2, dtype=DTYPE)
    kernel = rbf_kernel()
    working = (8 * 4096 + 4 * 2048) * 1000 * 8  # N-vectors of a prediction, in float64 bytes
    for free, expected in [
        (10 * working, 5 * working),  # plenty: half of it
        (working + 1000, 1000),  # the working set first
        (working // 2, 0),  # not even that: keep nothing
    ]:
        with gpsd.settings.memory_limit(cpu=free):
            operator = backend_module._matrix_free(kernel, x, torch.float64, None)
        assert operator.cache_bytes == expected
    assert backend_module._matrix_free(kernel, x, torch.float64, 123).cache_bytes == 123


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
    engine = model._current_fit().engine
    with torch.no_grad():
        DataCentricGPR(x, y, kernel, noise=gamma).predict(test_x)
        factor = engine.factor(gamma[..., 0].contiguous())
    assert seen == [(2, 3, 6)] and factor.shape[:-2].numel() == 6
