"""ModuleState: the snapshot that tells the caches a module changed (now one read per device)."""

import torch
from torch import nn

from gpsd._internal.module_state import ModuleState


def test_matches_until_any_value_shape_or_entry_changes():
    module = nn.Linear(3, 2).double()
    module.register_buffer("empty", torch.zeros(0))
    state = ModuleState(module)
    assert state.matches(module)
    with torch.no_grad():
        module.weight.data[1, 2] += 1e-12  # through .data: no version counter moves
    assert not state.matches(module)
    module = nn.Linear(3, 2).double()
    state = ModuleState(module)
    with torch.no_grad():
        module.bias.fill_(float("nan"))
    assert not ModuleState(module).matches(module)  # NaN equals nothing, as in torch.equal
    module.bias = nn.Parameter(torch.zeros(3, dtype=torch.float64))  # a new shape
    assert not state.matches(module)
    assert not ModuleState(nn.Linear(3, 2)).matches(nn.Linear(3, 2, bias=False))
