"""ParticleEnsemble.particle_module for networks with a non-persistent buffer."""

import torch
from torch import nn

from gpsd.dpkl import ParticleEnsemble


class _ShiftNet(nn.Module):
    """A network with a non-persistent buffer (a fixed input shift, say)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 3), persistent=False)

    def forward(self, x):
        return self.lin(x - self.shift)


def test_particle_module_of_a_network_with_a_non_persistent_buffer():
    # particle_module used to raise RuntimeError ('Unexpected key(s) in state_dict: "shift"'):
    # the stacked buffers include the non-persistent one, which load_state_dict rejects. The copy
    # must evaluate to the ensemble's particle and keep the buffer non-persistent.
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
