import copy
import pickle
from dataclasses import dataclass

import gpytorch
import pytest
import torch

import gpsd
from gpsd._internal.fitted import FitDependencies, Fitted


@dataclass(frozen=True)
class _ToyFit:
    number: int
    value: torch.Tensor


class _Toy(Fitted, gpytorch.Module):
    """A fit of a kernel matrix's sum that counts its computations and parts."""

    _resizable_buffers = ("train_x",)

    def __init__(self, follows_gradients: bool = True) -> None:
        super().__init__()
        self.covar_module = gpytorch.kernels.RBFKernel()
        self.register_buffer("train_x", torch.linspace(0, 1, 4).unsqueeze(-1))
        self.option = "a"
        self.follows = follows_gradients
        self.computed = 0
        self.parts = 0

    def _fit_dependencies(self) -> FitDependencies:
        return FitDependencies((self.covar_module,), (self.train_x,), (self.option,))

    def _compute_fit(self, **options) -> _ToyFit:
        self.computed += 1
        part = self._fit_part(
            "matrix",
            FitDependencies((self.covar_module,), (self.train_x,)),
            self._matrix,
            lambda value: self.follows,
        )
        return _ToyFit(self.computed, part.sum())

    def _matrix(self) -> torch.Tensor:
        self.parts += 1
        return self.covar_module(self.train_x).to_dense()

    def _fit_follows_gradients(self, fit: _ToyFit) -> bool:
        return self.follows


def test_fit_returns_the_estimator_and_a_prediction_reuses_its_fit():
    model = _Toy()
    assert model.fit() is model
    first = model._current_fit()
    assert model._current_fit() is first
    assert model.computed == 1 and model.parts == 1


def test_the_fit_is_computed_lazily_on_first_use():
    model = _Toy()
    assert model.computed == 0
    assert model._current_fit().number == 1


def test_fit_refuses_a_bad_progress_or_callback():
    with pytest.raises(TypeError, match="callback"):
        _Toy().fit(callback=5)
    with pytest.raises(TypeError, match="progress"):
        _Toy().fit(progress="yes")


@pytest.mark.parametrize(
    "change",
    [
        "parameter step",
        "data write",
        "load_state_dict",
        "to dtype",
        "buffer assignment",
        "buffer write",
        "setting of the estimator",
    ],
)
def test_each_change_of_a_dependency_refits(change):
    model = _Toy()
    model._current_fit()
    if change == "parameter step":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model._current_fit().value.backward()
        optimizer.step()
    elif change == "data write":
        model.covar_module.raw_lengthscale.data.add_(0.5)
    elif change == "load_state_dict":
        other = _Toy()
        other.covar_module.lengthscale = 3.0
        model.load_state_dict(other.state_dict())
    elif change == "to dtype":
        model.double()
    elif change == "buffer assignment":
        model.train_x = model.train_x + 1
    elif change == "buffer write":
        model.train_x[0] = 7.0
    else:
        model.option = "b"
    assert model._current_fit().number == 2


def test_a_setting_that_changes_results_refits_and_one_of_memory_alone_does_not():
    model = _Toy()
    model._current_fit()
    with gpsd.settings.test_chunk_size(3), gpsd.settings.kernel_cache_fraction(0.1):
        assert model._current_fit().number == 1
    with gpsd.settings.max_lanczos_rank(3):
        assert model._current_fit().number == 2
    assert model._current_fit().number == 3  # back under the defaults


def test_a_state_or_device_change_that_changes_nothing_keeps_the_fit():
    model = _Toy()
    first = model._current_fit()
    model.load_state_dict(model.state_dict())
    model.to(torch.float32)
    assert model._current_fit() is first


def test_a_setting_of_the_estimator_alone_reuses_the_part():
    model = _Toy()
    model._current_fit()
    model.option = "b"
    model._current_fit()
    assert (model.computed, model.parts) == (2, 1)
    model.covar_module.lengthscale = 2.0
    model._current_fit()
    assert (model.computed, model.parts) == (3, 2)


def test_a_fit_without_a_graph_is_refitted_once_a_graph_is_needed_where_it_follows_gradients():
    model = _Toy()
    with torch.no_grad():
        model._current_fit()
    assert model._current_fit().number == 2  # a graph is needed now
    frozen = _Toy(follows_gradients=False)
    with torch.no_grad():
        frozen._current_fit()
    assert frozen._current_fit().number == 1


def test_a_fit_made_with_a_graph_serves_under_no_grad():
    model = _Toy()
    model._current_fit()
    with torch.no_grad():
        assert model._current_fit().number == 1
    assert model._current_fit().number == 1


def test_a_fit_made_under_grad_mode_from_frozen_modules_serves_under_no_grad():
    model = _Toy()
    model.covar_module.raw_lengthscale.requires_grad_(False)
    model.fit()  # grad mode, but no graph: nothing requires a gradient
    with torch.no_grad():
        assert model._current_fit().number == 1
    # a parameter that comes to require a gradient needs the graph the fit lacks
    model.covar_module.raw_lengthscale.requires_grad_(True)
    assert model._current_fit().number == 2


def test_a_backward_pass_through_the_fit_makes_it_stale():
    model = _Toy()
    first = model._current_fit()
    assert model._current_fit() is first
    first.value.backward()
    second = model._current_fit()
    assert second is not first and model.parts == 2  # the part's graph was freed too
    second.value.backward()  # the refitted graph is whole


def test_copies_and_pickles_carry_no_fit_and_refit_on_first_use():
    model = _Toy()
    model._current_fit()
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other._current_fit().number == 2  # the counter was copied, the fit was not
        torch.testing.assert_close(other._current_fit().value, model._current_fit().value)
    assert model._current_fit().number == 1


def test_a_state_with_buffers_of_other_shapes_loads_and_refits():
    model, other = _Toy(), _Toy()
    model._current_fit()
    other.train_x = torch.linspace(0, 1, 6).unsqueeze(-1)
    model.load_state_dict(other.state_dict())
    assert model.train_x.shape == (6, 1)
    assert model._current_fit().number == 2
    torch.testing.assert_close(model._current_fit().value, other._current_fit().value)
