import asyncio
import threading

import pytest

import gpsd
from gpsd import settings
from gpsd.linalg import free_memory_bytes


def test_a_setting_changes_inside_its_block_and_is_restored_after():
    default = settings.test_chunk_size.value()
    with settings.test_chunk_size(7):
        assert settings.test_chunk_size.value() == 7
        with settings.test_chunk_size(3):
            assert settings.test_chunk_size.value() == 3
        assert settings.test_chunk_size.value() == 7
    assert settings.test_chunk_size.value() == default


def test_a_setting_is_restored_when_an_exception_leaves_the_block():
    default = settings.max_lanczos_rank.value()
    with pytest.raises(KeyError), settings.max_lanczos_rank(8):
        raise KeyError("boom")
    assert settings.max_lanczos_rank.value() == default


def test_device_settings_take_one_value_or_values_per_device_type():
    cpu, cuda = settings.dense_max_n.value("cpu"), settings.dense_max_n.value("cuda")
    with settings.dense_max_n(100):
        assert settings.dense_max_n.value("cpu") == settings.dense_max_n.value("cuda:0") == 100
    with settings.dense_max_n(cpu=50):
        assert settings.dense_max_n.value("cpu") == 50
        assert settings.dense_max_n.value("cuda") == cuda
    assert settings.dense_max_n.value("cpu") == cpu
    assert settings.dense_max_n.value() == {"cpu": cpu, "cuda": cuda}
    # device types without their own value take CUDA's (an accelerator)
    assert settings.max_chain_factorisations.value(
        "mps"
    ) == settings.max_chain_factorisations.value("cuda")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: settings.test_chunk_size(0), "test_chunk_size must be an int >= 1"),
        (lambda: settings.test_chunk_size(2.5), "test_chunk_size must be an int"),
        (lambda: settings.test_chunk_size(True), "test_chunk_size must be an int"),
        (lambda: settings.keep_kernel_rows_after(-1), "keep_kernel_rows_after must be an int >= 0"),
        (lambda: settings.trace_probes(1), "trace_probes must be an int >= 2"),
        (lambda: settings.trace_probe_seed(-1), "trace_probe_seed must be an int >= 0"),
        (
            lambda: settings.kernel_cache_fraction(0),
            r"kernel_cache_fraction must be a number in \(0, 1\]",
        ),
        (lambda: settings.kernel_cache_fraction(1.5), "kernel_cache_fraction"),
        (lambda: settings.dense_max_n(0), "dense_max_n must be an int >= 1"),
        (lambda: settings.dense_max_n(10, cpu=5), "not both"),
        (lambda: settings.dense_max_n(), "needs a value"),
        (lambda: settings.memory_limit(cpu=-1), "memory_limit must be an int >= 0"),
        (lambda: settings.memory_limit(cuda=2.0**30), "memory_limit must be an int"),
    ],
)
def test_bad_setting_values_are_refused_with_the_settings_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "setting", [settings.dense_max_n, settings.max_chain_factorisations, settings.memory_limit]
)
def test_an_unknown_device_keyword_is_refused_naming_it_and_the_accepted_ones(setting):
    with pytest.raises(TypeError, match=r"unknown device keyword 'gpu'.*cpu, cuda"):
        setting(gpu=5)
    with pytest.raises(TypeError, match="'cuda0'"):
        setting(cpu=2, cuda0=5)


def test_a_device_setting_keeps_the_other_devices_value_in_force_where_it_is_entered():
    inner = settings.dense_max_n(cuda=7)  # made before the outer block is entered
    with settings.dense_max_n(cpu=50), inner:
        assert settings.dense_max_n.value("cpu") == 50
        assert settings.dense_max_n.value("cuda") == 7


def test_the_snapshot_changes_with_every_setting_that_changes_results_and_only_in_its_block():
    before = settings.snapshot()
    changing = [
        settings.max_lanczos_rank(2),
        settings.cg_deflation_rank(3),
        settings.dense_memory_fraction(0.5),
        settings.dense_max_n(cpu=3),
        settings.max_chain_factorisations(cuda=7),
        settings.memory_limit(cpu=2**20),
    ]
    memory_only = [
        settings.test_chunk_size(1),
        settings.kernel_cache_fraction(0.25),
        settings.keep_kernel_rows_after(0),
        settings.max_chunk_elements(9),
        # the probes change the GCV estimates alone, which the models key on these themselves
        settings.trace_probes(2),
        settings.trace_probe_seed(5),
    ]
    for setting in changing:
        with setting:
            assert settings.snapshot() != before, type(setting).__name__
    for setting in memory_only:
        with setting:
            assert settings.snapshot() == before, type(setting).__name__
    assert settings.snapshot() == before
    public = {name for name in settings.__all__ if name != "snapshot"}
    assert public == {type(s).__name__ for s in changing + memory_only}


def test_the_memory_limit_caps_the_free_memory_of_its_device_type_only_in_its_block():
    measured = free_memory_bytes("cpu")
    assert settings.memory_limit.value() == {"cpu": None, "cuda": None}  # no limit by default
    with settings.memory_limit(cpu=1000):
        assert free_memory_bytes("cpu") == 1000
        assert settings.memory_limit.value("cuda") is None
        with settings.memory_limit(0):
            assert free_memory_bytes("cpu") == 0
        assert free_memory_bytes("cpu") == 1000
    # a limit above the free memory leaves it as measured (about: the host's memory moves)
    with settings.memory_limit(cpu=2**62):
        assert abs(free_memory_bytes("cpu") - measured) < measured / 2
    assert free_memory_bytes("cpu") > 1000


def test_settings_are_exported_from_the_package():
    assert gpsd.settings is settings
    for name in settings.__all__:
        assert hasattr(settings, name)


def test_two_threads_nesting_a_setting_leave_each_others_values_alone():
    default = settings.test_chunk_size.value()
    a_entered, b_entered, a_left = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with settings.test_chunk_size(5):
            a_entered.set()
            b_entered.wait(5)
            seen["a inside, b inside"] = settings.test_chunk_size.value()
            with settings.test_chunk_size(7):
                seen["a nested"] = settings.test_chunk_size.value()
            seen["a after nesting"] = settings.test_chunk_size.value()
        a_left.set()
        seen["a left"] = settings.test_chunk_size.value()

    def thread_b():
        a_entered.wait(5)
        seen["b before entering"] = settings.test_chunk_size.value()
        with settings.test_chunk_size(6):
            b_entered.set()
            a_left.wait(5)
            seen["b inside, a left"] = settings.test_chunk_size.value()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    with settings.test_chunk_size(3):  # the main thread's block is its own as well
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert settings.test_chunk_size.value() == 3
    assert seen == {
        "b before entering": default,
        "a inside, b inside": 5,
        "a nested": 7,
        "a after nesting": 5,
        "a left": default,
        "b inside, a left": 6,
    }
    assert settings.test_chunk_size.value() == default


def test_two_asyncio_tasks_nesting_a_setting_leave_each_others_values_alone():
    async def task(value, seen, entered, read):
        with settings.max_lanczos_rank(value):
            entered[value].set()
            await asyncio.gather(*(event.wait() for event in entered.values()))
            seen[value] = settings.max_lanczos_rank.value()
            read[value].set()
            await asyncio.gather(*(event.wait() for event in read.values()))

    async def main():
        seen = {}
        entered = {11: asyncio.Event(), 12: asyncio.Event()}
        read = {11: asyncio.Event(), 12: asyncio.Event()}
        await asyncio.gather(task(11, seen, entered, read), task(12, seen, entered, read))
        return seen

    default = settings.max_lanczos_rank.value()
    assert asyncio.run(main()) == {11: 11, 12: 12}
    assert settings.max_lanczos_rank.value() == default


def test_one_setting_instance_entered_in_two_threads_restores_each_threads_value():
    shared = settings.cg_deflation_rank(9)
    barrier = threading.Barrier(2)
    seen = {}

    def work(outer):
        with settings.cg_deflation_rank(outer):
            with shared:
                barrier.wait(5)
            barrier.wait(5)  # both threads have left the shared block
            seen[outer] = settings.cg_deflation_rank.value()

    threads = [threading.Thread(target=work, args=(v,)) for v in (5, 6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {5: 5, 6: 6}


def test_blocks_in_two_threads_restore_the_default():
    default = settings.test_chunk_size.value()
    barrier = threading.Barrier(2)

    def work(value):
        with settings.test_chunk_size(value):
            barrier.wait()

    threads = [threading.Thread(target=work, args=(v,)) for v in (5, 6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert settings.test_chunk_size.value() == default
