"""Tests of SteinVariationalGradient."""

import math
import statistics

import pytest
import torch
from svgd_reference import loop_direction
from torch import nn

from gpsd.dpkl import ParticleEnsemble, SteinVariationalGradient


def _median_h(w):
    m = w.shape[0]
    d = sorted(float((w[i] - w[j]).pow(2).sum()) for i in range(m) for j in range(i + 1, m))
    mid = len(d) // 2
    med = d[mid] if len(d) % 2 else 0.5 * (d[mid - 1] + d[mid])
    return med / math.log(m)


def test_transform_leaves_frozen_parameters_alone():
    # SVGD([ensemble.parameters()]) (the docstring's example) wrote a repulsion gradient into a
    # frozen bias (then stepped by any optimiser holding it) and counted it in the distances
    torch.manual_seed(0)
    ens = ParticleEnsemble(lambda: nn.Linear(3, 2, dtype=torch.float64), 4)
    frozen = ens.particle_parameters["bias"].requires_grad_(False)
    weight = ens.particle_parameters["weight"]
    ens(torch.randn(5, 3, dtype=torch.float64)).pow(2).sum().backward()
    g = weight.grad.detach().reshape(4, -1).clone()
    w = weight.detach().reshape(4, -1).clone()
    SteinVariationalGradient(ens.parameters(), repulsion=1.0).transform_()
    assert frozen.grad is None
    ref = loop_direction(w, g, _median_h(w), 1.0, 1.0)
    torch.testing.assert_close(weight.grad.reshape(4, -1), ref, rtol=1e-10, atol=1e-12)
    opt = torch.optim.SGD(ens.parameters(), lr=0.1, weight_decay=0.1)
    before = frozen.detach().clone()
    opt.step()
    torch.testing.assert_close(frozen, before, rtol=0, atol=0)


def test_transform_of_only_frozen_parameters_is_a_no_op():
    w = torch.randn(3, 2)
    SteinVariationalGradient([w], repulsion=1.0).transform_()
    assert w.grad is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_particles(dtype):
    # torch.quantile raised 'input tensor must be either float or double dtype'
    gen = torch.Generator().manual_seed(1)
    w64 = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    g64 = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    w = w64.to(dtype).requires_grad_(True)
    w.grad = g64.to(dtype)
    h = SteinVariationalGradient.median_bandwidth(w.detach())
    assert h.dtype == dtype
    wq, gq = w.detach().double(), w.grad.double()  # the values the transform sees
    assert float(h) == pytest.approx(_median_h(wq), rel=2e-2)
    SteinVariationalGradient([w], repulsion=1.0).transform_()
    assert w.grad.dtype == dtype
    ref = loop_direction(wq, gq, _median_h(wq), 1.0, 1.0)
    assert float((w.grad.double() - ref).norm() / ref.norm()) < 5e-2


def test_missing_grad_of_a_parameter_in_another_dtype():
    # the float64-promoted direction must be cast to a float32 parameter's missing .grad
    # (else: RuntimeError "attempting to assign a gradient with dtype 'double'")
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(3, 2, generator=gen).requires_grad_(True)
    b = torch.randn(3, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    b.grad = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    w = torch.cat([a.detach().double(), b.detach()], -1)
    g = torch.cat([torch.zeros(3, 2, dtype=torch.float64), b.grad], -1)
    SteinVariationalGradient([a, b], repulsion=1.0).transform_()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float64
    ref = loop_direction(w, g, _median_h(w), 1.0, 1.0)
    torch.testing.assert_close(a.grad, ref[:, :2].float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, ref[:, 2:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["joint", "per_particle"])
@pytest.mark.parametrize("tau", [0.0, 1.0, 0.3])
@pytest.mark.parametrize("bandwidth", ["median", 2.5])
def test_transform_equals_loop(loss_type, tau, bandwidth):
    torch.set_default_dtype(torch.float64)
    m = 5
    a = torch.randn(m, 3, 2, requires_grad=True)
    b = torch.randn(m, 4, requires_grad=True)
    ga, gb = torch.randn(m, 3, 2), torch.randn(m, 4)
    a.grad, b.grad = ga.clone(), gb.clone()
    svgd = SteinVariationalGradient([a, b], bandwidth=bandwidth, repulsion=tau, loss_type=loss_type)
    svgd.transform_()
    flat_w = torch.cat([a.detach().reshape(m, -1), b.detach().reshape(m, -1)], -1)
    flat_g = torch.cat([ga.reshape(m, -1), gb.reshape(m, -1)], -1)
    if bandwidth == "median":
        d = [float(((flat_w[i] - flat_w[j]) ** 2).sum()) for i in range(m) for j in range(i + 1, m)]
        med_sq = statistics.median(d)  # 10 pairs: the mean of the two middle values
        h = med_sq / math.log(m)
    else:
        h = bandwidth
    c = 1.0 if loss_type == "joint" else 1.0 / m
    ref = loop_direction(flat_w, flat_g, h, c, tau)
    got = torch.cat([a.grad.reshape(m, -1), b.grad.reshape(m, -1)], -1)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_flat_loss_moves_two_particles_apart():
    w = torch.tensor([[0.0, 0.0], [0.3, 0.1]], requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.05)
    svgd = SteinVariationalGradient([w], repulsion=1.0)
    dist0 = float((w[0] - w[1]).detach().norm())
    for _ in range(20):
        opt.zero_grad()
        (0.0 * w.sum()).backward()  # a flat loss
        svgd.transform_()
        opt.step()
    assert float((w[0] - w[1]).detach().norm()) > dist0 * 1.05
    # the paper's update (no repulsion) leaves them where they are
    v = torch.tensor([[0.0, 0.0], [0.3, 0.1]], requires_grad=True)
    v.grad = torch.zeros_like(v)
    SteinVariationalGradient([v], repulsion=0.0).transform_()
    assert torch.count_nonzero(v.grad) == 0


def test_single_particle_is_plain_gradient():
    w = torch.randn(1, 7, requires_grad=True)
    g = torch.randn(1, 7)
    w.grad = g.clone()
    SteinVariationalGradient([w], repulsion=1.0).transform_()
    torch.testing.assert_close(w.grad, g)


def test_svgd_samples_a_gaussian():
    """Per-particle SVGD with repulsion recovers N(1, 0.5^2) (independent check of the signs)."""
    torch.manual_seed(0)
    w = (torch.randn(60, 1) * 0.1 - 2.0).requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.1)
    svgd = SteinVariationalGradient([w], repulsion=1.0, loss_type="per_particle")
    for _ in range(600):
        opt.zero_grad()
        (0.5 * ((w - 1.0) / 0.5) ** 2).sum().backward()
        svgd.transform_()
        opt.step()
    assert abs(float(w.detach().mean()) - 1.0) < 0.05
    assert abs(float(w.detach().std()) - 0.5) < 0.1


def test_bad_arguments():
    w = torch.randn(3, 2, requires_grad=True)
    with pytest.raises(ValueError, match="bandwidth"):
        SteinVariationalGradient([w], bandwidth=-1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        SteinVariationalGradient([w], bandwidth="mean")
    with pytest.raises(ValueError, match="repulsion"):
        SteinVariationalGradient([w], repulsion=-1.0)
    with pytest.raises(ValueError, match="loss_type"):
        SteinVariationalGradient([w], loss_type="sum")
    with pytest.raises(ValueError, match="leading particle dimension"):
        SteinVariationalGradient([w, torch.randn(4, 2)])
    with pytest.raises(ValueError, match="at least one"):
        SteinVariationalGradient([])
    w.grad = torch.full_like(w, float("nan"))
    with pytest.raises(ValueError, match="gradients hold NaN"):
        SteinVariationalGradient([w]).transform_()
    # a NaN in one particle made every particle's direction NaN, silently
    w.grad = torch.ones_like(w)
    with torch.no_grad():
        w[1, 0] = float("nan")
    with pytest.raises(ValueError, match="parameters hold NaN"):
        SteinVariationalGradient([w]).transform_()


def test_float32_bandwidth_and_direction_of_particles_far_from_the_origin():
    gen = torch.Generator().manual_seed(0)
    w = 100.0 + 0.01 * torch.randn(10, 1000, generator=gen, dtype=torch.float64)
    g = torch.randn(10, 1000, generator=gen, dtype=torch.float64)
    d = torch.pdist(w).pow(2)  # 45 pairs: an odd count, so the median is one of them
    ref_h = float(d.median()) / math.log(10)
    h32 = SteinVariationalGradient.median_bandwidth(w.float())
    assert float(h32) == pytest.approx(ref_h, rel=1e-4)
    svgd = SteinVariationalGradient([w.clone()], repulsion=1.0)
    ref = loop_direction(w, g, ref_h, 1.0, 1.0)
    got = svgd.direction(w.float(), g.float()).double()
    assert float((got - ref).norm() / ref.norm()) < 1e-4
