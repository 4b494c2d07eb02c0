import threading

import pytest

import gpsd
from gpsd import settings


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
    ],
)
def test_bad_setting_values_are_refused_with_the_settings_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_snapshot_changes_with_every_setting_that_changes_results_and_only_in_its_block():
    before = settings.snapshot()
    changing = [
        settings.max_lanczos_rank(2),
        settings.cg_deflation_rank(3),
        settings.dense_memory_fraction(0.5),
        settings.dense_max_n(cpu=3),
        settings.max_chain_factorisations(cuda=7),
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


def test_settings_are_exported_from_the_package():
    assert gpsd.settings is settings
    for name in settings.__all__:
        assert hasattr(settings, name)


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
