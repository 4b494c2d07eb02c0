"""The continuous-categorical log-normaliser and its gradient against mpmath, finite differences
and the continuous Bernoulli."""

import random

import cc_reference
import mpmath
import pytest
import torch

from gpsd.likelihoods import cb_log_normalizer, cc_log_normalizer, cc_mean

#: the bound the module docs state, in machine epsilons of max(|A|, |A - max(eta)|)
STATED_BOUND = {torch.float64: 3.0, torch.float32: 1.0}


def _clustered(rng: random.Random, K: int) -> list[float]:
    """Parameters in up to 5 clusters (jitter 0 to 1) separated by gaps of 0.1 to 3000."""
    num_clusters = rng.randint(1, min(K, 5))
    sizes = [1] * num_clusters
    for _ in range(K - num_clusters):
        sizes[rng.randrange(num_clusters)] += 1
    x = rng.uniform(-1e4, 1e4) if rng.random() < 0.3 else rng.uniform(-5.0, 5.0)
    nodes = []
    for size in sizes:
        jitter = rng.choice([0.0, 1e-12, 1e-6, 1e-3, 0.1, 1.0])
        nodes += [x + rng.uniform(-jitter, jitter) for _ in range(size)]
        x -= 10 ** rng.uniform(-1.0, 3.5)
    rng.shuffle(nodes)
    return nodes


def _sweep() -> list[list[float]]:
    rng = random.Random(43)
    cases = []
    for K in (2, 3, 4, 6, 10, 20):
        cases += [[0.0] * K, [1e4] * K, [-3.7] * K, [1e4] * (K - 1) + [-1e4]]
        for scale in (1e-9, 1e-4, 0.1, 1.0, 5.0, 30.0, 300.0, 1e4):
            cases.append([rng.uniform(-scale, scale) for _ in range(K)])
        cases += [_clustered(rng, K) for _ in range(10)]
        # where the table switches from the Taylor series to Newton's recurrence (3 per node)
        for o in sorted({1, K // 2, K - 1}):
            for factor in (0.999, 1.001):
                cases.append([0.0] * (K - o) + [-3.0 * o * factor] * o)
        # a Taylor entry at the largest spread 3 (K - 1), its series' slowest tail
        tau = 3.0 * (K - 1) * 0.9999
        cases += [[0.0] * (K - 1) + [-tau], [tau * k / (K - 1) for k in range(K)]]
    return cases


SWEEP = _sweep()
REFERENCE = {}


def _reference(case: tuple[float, ...]) -> mpmath.mpf:
    if case not in REFERENCE:
        REFERENCE[case] = cc_reference.log_normalizer(list(case))
    return REFERENCE[case]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_log_normalizer_is_within_the_stated_bound_of_mpmath_over_the_sweep(dtype):
    eps = torch.finfo(dtype).eps
    worst = 0.0
    for case in SWEEP:
        eta = torch.tensor(case, dtype=dtype)  # rounded to dtype: the reference takes these
        value = cc_log_normalizer(eta)
        assert value.dtype == dtype and value.shape == ()
        exact = _reference(tuple(eta.tolist()))
        # (1e-40: the reference moves ties apart by 1e-60, so A = 0 of K = 2 ties is 1e-61 there)
        scale = max(abs(exact), abs(exact - max(eta.tolist())), mpmath.mpf(1e-40))
        error = float(abs(mpmath.mpf(value.item()) - exact) / scale) / eps
        assert error <= STATED_BOUND[dtype], (case, error)
        worst = max(worst, error)
    assert worst > 0.1 * STATED_BOUND[dtype]  # the sweep reaches the rounding level


def test_closed_form_cancels_where_the_log_normalizer_does_not():
    # the closed form in float64 at three parameters 1e-5 apart has nothing left
    eta = [0.3, 0.3 + 1e-5, 0.3 - 1e-5]
    naive = sum(
        torch.exp(torch.tensor(a, dtype=torch.float64)).item() / ((a - b) * (a - c))
        for a, b, c in [
            (eta[0], eta[1], eta[2]),
            (eta[1], eta[0], eta[2]),
            (eta[2], eta[0], eta[1]),
        ]
    )
    exact = cc_reference.log_normalizer(eta)
    assert abs(mpmath.log(naive) - exact) > 1e-8
    value = cc_log_normalizer(torch.tensor(eta, dtype=torch.float64)).item()
    assert abs(value - exact) <= 3 * torch.finfo(torch.float64).eps * abs(exact)


GRADIENT_CASES = [SWEEP[i] for i in range(0, len(SWEEP), 8) if len(SWEEP[i]) <= 10]
GRADIENT_CASES += [[0.0] * 10 + [1e-3] * 9 + [-7.0], [2.0, 2.0, 2.0 + 1e-9, -40.0]]


MEAN_REFERENCE = {}


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-13), (torch.float32, 1.2e-7)])
def test_gradient_is_the_mean_of_mpmath(dtype, rtol):
    for case in GRADIENT_CASES:
        eta = torch.tensor(case, dtype=dtype, requires_grad=True)
        (grad,) = torch.autograd.grad(cc_log_normalizer(eta), eta)
        mean = cc_mean(eta)
        key = tuple(eta.tolist())
        if key not in MEAN_REFERENCE:
            MEAN_REFERENCE[key] = cc_reference.mean(list(key))
        exact = MEAN_REFERENCE[key]
        for g, m, e in zip(grad.tolist(), mean.tolist(), exact, strict=True):
            assert abs(g - e) <= rtol * e, (case, g, e)
            assert abs(m - e) <= rtol * e, (case, m, e)


@pytest.mark.parametrize(
    "case",
    [
        [0.0, 0.0, 0.0],
        [0.2, 0.2 + 1e-7, -0.1, 0.4],
        [1.0, -2.0, -2.0, -2.0, 5.0],
        [0.0, -5.99, -6.01, -30.0],
        [3.0] * 6 + [-1.5] * 4,
    ],
)
def test_gradient_matches_central_differences(case):
    eta = torch.tensor(case, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(cc_log_normalizer(eta), eta)
    h = 1e-5
    for k in range(len(case)):
        step = torch.zeros(len(case), dtype=torch.float64)
        step[k] = h
        difference = (cc_log_normalizer(eta + step) - cc_log_normalizer(eta - step)) / (2 * h)
        assert abs(difference.item() - grad[k].item()) <= 1e-8, (case, k)
    assert torch.autograd.gradcheck(cc_log_normalizer, (eta.detach().requires_grad_(),))


def test_mean_lies_in_the_simplex():
    generator = torch.Generator().manual_seed(0)
    eta = torch.randn(200, 7, generator=generator, dtype=torch.float64) * torch.logspace(
        -6, 3, 200, dtype=torch.float64
    ).unsqueeze(-1)
    mean = cc_mean(eta)
    assert (mean > 0).all() and (mean < 1).all()
    torch.testing.assert_close(
        mean.sum(-1), torch.ones(200, dtype=torch.float64), rtol=0, atol=1e-15
    )


def test_shift_and_permutation():
    generator = torch.Generator().manual_seed(1)
    eta = torch.randn(50, 5, generator=generator, dtype=torch.float64) * 4
    base = cc_log_normalizer(eta)
    # A(eta + c) = A(eta) + c; the shift 1024 is exact in float64 for these magnitudes
    torch.testing.assert_close(cc_log_normalizer(eta + 1024.0), base + 1024.0, rtol=1e-15, atol=0)
    permutation = torch.randperm(5, generator=generator)
    torch.testing.assert_close(cc_log_normalizer(eta[:, permutation]), base, rtol=1e-15, atol=0)
    torch.testing.assert_close(cc_mean(eta[:, permutation]), cc_mean(eta)[:, permutation])


def test_two_categories_are_the_continuous_bernoulli():
    # exp[eta_0, eta_1] = e^{eta_0} (e^f - 1) / f with f = eta_1 - eta_0: A = eta_0 + A_CB(f)
    eta0 = torch.tensor([0.0, 1.5, -3.0, 200.0, 1e-7], dtype=torch.float64)
    f = torch.tensor([0.0, 1e-6, 2.5, -40.0, 3.0], dtype=torch.float64)
    eta = torch.stack([eta0, eta0 + f], dim=-1)
    torch.testing.assert_close(
        cc_log_normalizer(eta), eta0 + cb_log_normalizer(f), rtol=1e-15, atol=1e-15
    )


def test_batch_shapes():
    eta = torch.randn(2, 3, 4, dtype=torch.float64)
    assert cc_log_normalizer(eta).shape == (2, 3)
    assert cc_mean(eta).shape == (2, 3, 4)
    assert cc_log_normalizer(torch.zeros(0, 4)).shape == (0,)
    torch.testing.assert_close(cc_log_normalizer(eta)[1, 2], cc_log_normalizer(eta[1, 2]))


def test_rejects_bad_parameters():
    with pytest.raises(TypeError, match="eta must be a floating-point tensor"):
        cc_log_normalizer(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="eta must be a torch.Tensor"):
        cc_mean([0.1, 0.2])
    with pytest.raises(ValueError, match="K >= 2"):
        cc_log_normalizer(torch.zeros(3, 1))
    with pytest.raises(ValueError, match="K >= 2"):
        cc_log_normalizer(torch.tensor(0.5))
    with pytest.raises(ValueError, match="eta must be finite"):
        cc_log_normalizer(torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="underflows"):
        cc_log_normalizer(torch.tensor([0.0] + [-1e200] * 19, dtype=torch.float64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_agrees_with_cpu():
    eta = torch.tensor([c[:3] for c in SWEEP if len(c) >= 3], dtype=torch.float64)
    value = cc_log_normalizer(eta.cuda())
    assert value.device.type == "cuda"
    torch.testing.assert_close(value.cpu(), cc_log_normalizer(eta), rtol=1e-15, atol=0)
    torch.testing.assert_close(cc_mean(eta.cuda()).cpu(), cc_mean(eta), rtol=1e-14, atol=0)
