"""Tests of ParticleEnsemble."""

import copy
import warnings

import pytest
import torch
from conftest import requires_cuda
from torch import nn

from gpsd.dpkl import (
    ParticleEnsemble,
)

DT = torch.float64


def _net(d_in=4):
    return lambda: nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, 2)).to(DT)


class _Projection(nn.Module):
    """A network with a plain parameter and no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, 2, dtype=DT))

    def forward(self, x):
        return x @ self.weight


def test_identical_particles_are_reported():
    with pytest.warns(UserWarning, match="all 4 particles start with identical"):
        ParticleEnsemble(_Projection(), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ParticleEnsemble(_Projection(), 4, reinitialise=False)  # asked for copies
        ParticleEnsemble(_net(3), 4)  # a factory of fresh networks
        ParticleEnsemble(_Projection(), 1)


class _ShiftNet(nn.Module):
    """A network with a non-persistent buffer (a fixed input shift, say)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 3), persistent=False)

    def forward(self, x):
        return self.lin(x - self.shift)


def test_particle_module_of_a_network_with_a_non_persistent_buffer():
    # the stacked buffers include the non-persistent one, which load_state_dict would reject
    # ('Unexpected key(s) in state_dict: "shift"'). The copy must evaluate to the ensemble's
    # particle and keep the buffer non-persistent.
    torch.set_default_dtype(torch.float64)
    ens = ParticleEnsemble(_ShiftNet, 3)
    with torch.no_grad():
        ens.stacked_buffers()["shift"].mul_(torch.tensor([1.0, 2.0, 3.0]).unsqueeze(-1))
    x = torch.randn(5, 3)
    out = ens(x)  # shape: (3, 5, 2)
    for i in range(3):
        module = ens.particle_module(i)
        torch.testing.assert_close(module(x), out[i], rtol=1e-12, atol=1e-12)
        assert "shift" not in module.state_dict()
        assert module.shift.device.type == "cpu"


def test_reinitialisation_keeps_a_frozen_weight_beside_a_trainable_bias():
    # a Linear with a frozen (pretrained) weight and a trainable bias is not reset whole: every
    # particle keeps the frozen weight
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
    # refused at construction, not at the first forward in vmap
    with pytest.raises(ValueError, match="module"):
        ParticleEnsemble(nn.Identity, 3)


def _net_bn():
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()


def test_ensemble_batchnorm_statistics_equal_a_loop_over_particles():
    from gpsd.dpkl import ParticleEnsemble

    torch.manual_seed(1)
    ensemble = ParticleEnsemble(_net_bn, 3)
    copies = [ensemble.particle_module(i).train() for i in range(3)]
    x = torch.randn(10, 3, dtype=torch.float64)
    out = ensemble(x)  # training mode: batch statistics, running statistics updated
    for i, module in enumerate(copies):
        torch.testing.assert_close(out[i], module(x))
        updated = ensemble.particle_module(i)[1]
        torch.testing.assert_close(updated.running_mean, module[1].running_mean)
        torch.testing.assert_close(updated.running_var, module[1].running_var)
        assert updated.running_mean.abs().max() > 0


def _dropout_net(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, d_out))


def _pretrained_frozen_body():
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    net[0].requires_grad_(False)  # a pretrained layer the user froze
    return net


def test_ensemble_eval_mode_reaches_dropout_and_batchnorm():
    # the architecture that evaluates the particles lives outside the module tree: eval() used
    # to leave its dropout on and its BatchNorm on batch statistics
    torch.set_default_dtype(torch.float64)
    x = torch.randn(6, 3)
    ens = ParticleEnsemble(_dropout_net, 3)
    assert not torch.equal(ens(x), ens(x))  # training mode: random masks
    ens.eval()
    loop = torch.stack([ens.particle_module(i).eval()(x) for i in range(3)])
    torch.testing.assert_close(ens(x), loop)
    ens.train()
    assert not torch.equal(ens(x), ens(x))

    def bn():
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))

    ens = ParticleEnsemble(bn, 2)
    with torch.no_grad():
        for name, buf in ens.stacked_buffers().items():
            if name.endswith("running_mean"):
                buf.fill_(3.0)
            elif name.endswith("running_var"):
                buf.fill_(4.0)
    ens.eval()
    loop = torch.stack([ens.particle_module(i).eval()(x) for i in range(2)])
    torch.testing.assert_close(ens(x), loop)


def test_frozen_parameters_stay_frozen_and_shared():
    # frozen layers stay frozen (not trainable stacked parameters) and are not re-initialised
    torch.set_default_dtype(torch.float64)
    net = _pretrained_frozen_body()
    ens = ParticleEnsemble(net, 3)
    body, head = ens.stacked_parameters()["0.weight"], ens.stacked_parameters()["2.weight"]
    assert not body.requires_grad and head.requires_grad
    for i in range(3):  # every particle keeps the pretrained body; the heads differ
        torch.testing.assert_close(body[i], net[0].weight, rtol=0, atol=0)
    assert not torch.equal(head[0], head[1])


def _net_e(d_in=5, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _ensemble_from(modules):
    it = iter(modules)
    return ParticleEnsemble(lambda: copy.deepcopy(next(it)), len(modules))


def test_batched_equals_loop_outputs_and_gradients():
    torch.set_default_dtype(torch.float64)
    modules = [_net_e() for _ in range(4)]
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
    ens = ParticleEnsemble(_net_e(), 3)
    x = torch.randn(6, 5)
    out = ens(x)
    for i in range(3):
        torch.testing.assert_close(out[i], ens.particle_module(i)(x))
    flat = ens.flat_parameters()
    assert flat.shape == (3, sum(p[0].numel() for p in ens.parameters()))
    assert not torch.allclose(flat[0], flat[1])  # re-initialised copies differ
    same = ParticleEnsemble(_net_e(), 3, reinitialise=False).flat_parameters()
    torch.testing.assert_close(same[0], same[2])


def test_optimiser_steps_all_particles():
    ens = ParticleEnsemble(_net_e, 3)
    before = ens.flat_parameters().detach().clone()
    opt = torch.optim.SGD(ens.parameters(), lr=0.1)
    ens(torch.randn(4, 5)).pow(2).sum().backward()
    grads = torch.cat([p.grad.reshape(3, -1) for p in ens.parameters()], -1)
    opt.step()
    torch.testing.assert_close(ens.flat_parameters().detach(), before - 0.1 * grads)


def test_state_dict_and_dtype_roundtrip():
    ens = ParticleEnsemble(_net_e, 2)
    other = ParticleEnsemble(_net_e, 2)
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
        ParticleEnsemble(_net_e, bad)


def test_bad_types():
    with pytest.raises(TypeError, match="num_particles"):
        ParticleEnsemble(_net_e, 2.0)
    with pytest.raises(TypeError, match="module"):
        ParticleEnsemble(3, 2)


@requires_cuda
def test_cuda():
    ens = ParticleEnsemble(_net_e, 3).cuda()
    x = torch.randn(4, 5, device="cuda")
    out = ens(x)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out[1], ens.particle_module(1).cuda()(x))


def test_inputs_of_the_wrong_width_name_both_widths():
    torch.set_default_dtype(torch.float64)
    ens = ParticleEnsemble(lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), 3)
    assert ens.in_features == 4
    with pytest.raises(
        ValueError, match="x has 3 input features, but the feature extractor expects 4"
    ):
        ens(torch.randn(5, 3))
    assert ens(torch.randn(2, 5, 4)).shape == (3, 2, 5, 2)  # batches of inputs
    # a network whose first layer says nothing of its width keeps the network's own error
    shifted = ParticleEnsemble(lambda: nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)), 2)
    assert shifted.in_features is None
    with pytest.raises(RuntimeError):
        shifted(torch.randn(5, 3))
