import copy
import pickle

import gpytorch
import torch

import gpsd
from gpsd._internal.fit_cache import FitCache


def build_counter():
    calls = []

    def build():
        calls.append(1)
        return len(calls)

    return calls, build


def test_the_value_is_reused_while_nothing_changes():
    kernel = gpytorch.kernels.RBFKernel()
    cache = FitCache()
    calls, build = build_counter()
    assert cache.get(kernel, ("a",), build) == 1
    assert cache.get(kernel, ("a",), build) == 1
    assert len(calls) == 1


def test_a_parameter_change_a_config_change_and_a_result_changing_setting_each_rebuild():
    kernel = gpytorch.kernels.RBFKernel()
    cache = FitCache()
    calls, build = build_counter()
    cache.get(kernel, (), build)
    kernel.lengthscale = 2.0
    assert cache.get(kernel, (), build) == 2
    assert cache.get(kernel, ("other",), build) == 3
    with gpsd.settings.max_lanczos_rank(3):
        assert cache.get(kernel, ("other",), build) == 4
    assert cache.get(kernel, ("other",), build) == 5  # back under the defaults


def test_a_setting_of_memory_alone_keeps_the_cached_value():
    kernel = gpytorch.kernels.RBFKernel()
    cache = FitCache()
    calls, build = build_counter()
    with gpsd.settings.test_chunk_size(3), gpsd.settings.kernel_cache_fraction(0.1):
        assert cache.get(kernel, (), build) == 1
    assert cache.get(kernel, (), build) == 1
    assert len(calls) == 1


def test_load_state_dict_and_a_dtype_change_rebuild():
    kernel = gpytorch.kernels.RBFKernel()
    other = gpytorch.kernels.RBFKernel()
    other.lengthscale = 3.0
    cache = FitCache()
    calls, build = build_counter()
    cache.get(kernel, (), build)
    kernel.load_state_dict(other.state_dict())
    cache.get(kernel, (), build)
    kernel.double()
    cache.get(kernel, (), build)
    assert len(calls) == 3


def test_a_value_without_a_graph_is_rebuilt_once_a_graph_is_needed_unless_switched_off():
    kernel = gpytorch.kernels.RBFKernel()  # its lengthscale requires a gradient
    cache = FitCache()
    calls, build = build_counter()
    with torch.no_grad():
        cache.get(kernel, (), build)  # built without a graph
    cache.get(kernel, (), build)  # a graph is needed now
    assert len(calls) == 2
    cache.clear()
    with torch.no_grad():
        cache.get(kernel, (), build)
    cache.grad_matters = False
    cache.get(kernel, (), build)
    assert len(calls) == 3


def test_a_value_built_with_a_graph_serves_under_no_grad():
    kernel = gpytorch.kernels.RBFKernel()
    cache = FitCache()
    calls, build = build_counter()
    cache.get(kernel, (), build)
    with torch.no_grad():
        cache.get(kernel, (), build)
    cache.get(kernel, (), build)
    assert len(calls) == 1


def test_a_value_built_under_grad_mode_from_frozen_modules_serves_under_no_grad():
    kernel = gpytorch.kernels.RBFKernel()
    kernel.raw_lengthscale.requires_grad_(False)
    cache = FitCache()
    calls, build = build_counter()
    cache.get(kernel, (), build)  # grad mode, but no graph: nothing requires a gradient
    with torch.no_grad():
        cache.get(kernel, (), build)
    assert len(calls) == 1
    # a parameter that comes to require a gradient needs the graph the value lacks
    kernel.raw_lengthscale.requires_grad_(True)
    cache.get(kernel, (), build)
    assert len(calls) == 2


def test_a_backward_pass_through_a_watched_tensor_invalidates_the_value():
    kernel = gpytorch.kernels.RBFKernel()
    cache = FitCache()

    def build():
        value = kernel(torch.ones(2, 1)).to_dense().sum()
        cache.watch(value)
        return value

    first = cache.get(kernel, (), build)
    assert cache.get(kernel, (), build) is first
    first.backward()
    assert cache.get(kernel, (), build) is not first


def test_copies_and_pickles_start_empty():
    kernel = gpytorch.kernels.RBFKernel()
    cache = FitCache()
    cache.get(kernel, (), lambda: "fitted")
    assert copy.deepcopy(cache).value is None
    assert pickle.loads(pickle.dumps(cache)).value is None
    assert cache.valid(kernel, ())
