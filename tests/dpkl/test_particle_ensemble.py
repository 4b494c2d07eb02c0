import copy

import pytest
import torch
from conftest import requires_cuda
from torch import nn

from gpsd.dpkl import ParticleEnsemble


def _net(d_in=5, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _ensemble_from(modules):
    it = iter(modules)
    return ParticleEnsemble(lambda: copy.deepcopy(next(it)), len(modules))


def test_batched_equals_loop_outputs_and_gradients():
    torch.set_default_dtype(torch.float64)
    modules = [_net() for _ in range(4)]
    ens = _ensemble_from(modules)
    x = torch.randn(11, 5)
    out = ens(x)  # (4, 11, 2)
    assert out.shape == (4, 11, 2)
    weights = torch.randn(4, 11, 2)
    (out * weights).sum().backward()
    loop_out = []
    for i, mod in enumerate(modules):
        o = mod(x)
        loop_out.append(o)
        (o * weights[i]).sum().backward()
    torch.testing.assert_close(out, torch.stack(loop_out), rtol=1e-12, atol=1e-12)
    stacked = ens.stacked_parameters()
    for name, p in stacked.items():
        ref = torch.stack([dict(m.named_parameters())[name].grad for m in modules])
        torch.testing.assert_close(p.grad, ref, rtol=1e-12, atol=1e-12)


def test_particle_module_roundtrip_and_reinitialisation():
    ens = ParticleEnsemble(_net(), 3)
    x = torch.randn(6, 5)
    out = ens(x)
    for i in range(3):
        torch.testing.assert_close(out[i], ens.particle_module(i)(x))
    flat = ens.flat_parameters()
    assert flat.shape == (3, sum(p[0].numel() for p in ens.parameters()))
    assert not torch.allclose(flat[0], flat[1])  # re-initialised copies differ
    same = ParticleEnsemble(_net(), 3, reinitialise=False).flat_parameters()
    torch.testing.assert_close(same[0], same[2])


def test_optimiser_steps_all_particles():
    ens = ParticleEnsemble(_net, 3)
    before = ens.flat_parameters().detach().clone()
    opt = torch.optim.SGD(ens.parameters(), lr=0.1)
    ens(torch.randn(4, 5)).pow(2).sum().backward()
    grads = torch.cat([p.grad.reshape(3, -1) for p in ens.parameters()], -1)
    opt.step()
    torch.testing.assert_close(ens.flat_parameters().detach(), before - 0.1 * grads)


def test_state_dict_and_dtype_roundtrip():
    ens = ParticleEnsemble(_net, 2)
    other = ParticleEnsemble(_net, 2)
    other.load_state_dict(ens.state_dict())
    x = torch.randn(3, 5)
    torch.testing.assert_close(other(x), ens(x))
    ens64 = ens.to(torch.float64)
    assert ens64(x.double()).dtype == torch.float64


def test_buffers_are_stacked():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("shift", torch.randn(2))

        def forward(self, x):
            return self.lin(x) + self.shift

    modules = [WithBuffer() for _ in range(3)]
    ens = _ensemble_from(modules)
    x = torch.randn(4, 3)
    torch.testing.assert_close(ens(x), torch.stack([m(x) for m in modules]))


@pytest.mark.parametrize("bad", [0, -2])
def test_bad_num_particles(bad):
    with pytest.raises(ValueError, match="num_particles"):
        ParticleEnsemble(_net, bad)


def test_bad_types():
    with pytest.raises(TypeError, match="num_particles"):
        ParticleEnsemble(_net, 2.0)
    with pytest.raises(TypeError, match="module"):
        ParticleEnsemble(3, 2)


@requires_cuda
def test_cuda():
    ens = ParticleEnsemble(_net, 3).cuda()
    x = torch.randn(4, 5, device="cuda")
    out = ens(x)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out[1], ens.particle_module(1).cuda()(x))
