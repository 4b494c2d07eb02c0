"""Audit of the SVGD transform and the particle ensemble: frozen parameters, low-precision and
mixed dtypes, and a module with nothing to stack."""

import math

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
    # the float64-promoted direction was assigned to a float32 parameter's missing .grad:
    # RuntimeError "attempting to assign a gradient with dtype 'double'"
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


def test_reinitialisation_keeps_a_frozen_weight_beside_a_trainable_bias():
    # a Linear with a frozen (pretrained) weight and a trainable bias was reset whole: every
    # particle got a new random, still frozen, weight
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    net[0].weight.requires_grad_(False)
    ens = ParticleEnsemble(net, 3)
    stacked = ens.stacked_parameters()
    assert not stacked["0.weight"].requires_grad and stacked["0.bias"].requires_grad
    for i in range(3):
        torch.testing.assert_close(stacked["0.weight"][i], net[0].weight, rtol=0, atol=0)
    assert not torch.equal(stacked["0.bias"][0], stacked["0.bias"][1])
    assert not torch.equal(stacked["2.weight"][0], stacked["2.weight"][1])


def test_a_module_without_parameters_or_buffers_is_named():
    # was accepted; the first forward failed in vmap ('Expected at least one Tensor to vmap over')
    with pytest.raises(ValueError, match="module"):
        ParticleEnsemble(nn.Identity, 3)
