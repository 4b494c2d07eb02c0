import io

import pytest
from tqdm import tqdm

from gpsd import IterationRecord
from gpsd._internal.progress_reporter import ProgressReporter, check_progress


def run_loop(reporter, iterations):
    done = 0
    with reporter:
        for i in range(1, iterations + 1):
            done = i
            if reporter.update(i, loss=1.0 / i, rank=2 * i):
                break
    return done


def test_the_callback_sees_one_record_per_iteration():
    records = []
    reporter = ProgressReporter("Model.fit", 4, callback=records.append)
    assert run_loop(reporter, 4) == 4
    assert [r.iteration for r in records] == [1, 2, 3, 4]
    assert records[1] == IterationRecord("Model.fit", 2, 4, 0.5, {"rank": 4})
    assert reporter.last == records[-1] and not reporter.stopped


def test_a_callback_returning_true_stops_the_loop_and_nothing_else_does():
    reporter = ProgressReporter("Model.fit", 10, callback=lambda r: r.iteration == 3)
    assert run_loop(reporter, 10) == 3
    assert reporter.stopped
    # truthy values other than True do not stop: only the documented signal does
    assert run_loop(ProgressReporter("Model.fit", 5, callback=lambda r: 1), 5) == 5


def test_progress_true_draws_a_bar_on_stderr_that_is_closed_at_the_end(capsys):
    reporter = ProgressReporter("Model.fit", 3, progress=True)
    run_loop(reporter, 3)
    assert "Model.fit" in capsys.readouterr().err and reporter._bar is None


def test_a_bar_of_the_callers_is_advanced_and_left_open():
    bar = tqdm(total=5, file=io.StringIO())
    run_loop(ProgressReporter("Model.fit", 5, progress=bar), 5)
    assert bar.n == 5 and not bar.disable
    bar.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"progress": "yes"}, "progress must be True, False or a tqdm"),
        ({"callback": 3}, "callback must be callable"),
    ],
)
def test_bad_progress_or_callback_arguments_are_named(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ProgressReporter("Model.fit", 3, **kwargs)


def test_check_progress_takes_the_documented_values_and_refuses_the_rest():
    bar = tqdm(total=1, file=io.StringIO())
    for progress in (True, False, None, bar):
        check_progress(progress, None)
        check_progress(progress, print)
    bar.close()
    for progress in ("yes", 1, object()):
        with pytest.raises(TypeError, match="progress must be True, False or a tqdm"):
            check_progress(progress, None)
    with pytest.raises(TypeError, match="callback must be callable or None, got int"):
        check_progress(False, 5)


def test_a_phase_is_named_in_every_record_and_on_the_bar(capsys):
    records = []
    run_loop(ProgressReporter("Model.fit", 2, True, records.append, phase="warm start"), 2)
    assert records[0] == IterationRecord("Model.fit", 1, 2, 1.0, {"rank": 2}, "warm start")
    assert [r.phase for r in records] == ["warm start"] * 2
    assert "Model.fit (warm start)" in capsys.readouterr().err
    run_loop(ProgressReporter("Model.fit", 1, callback=records.append), 1)
    assert records[-1].phase is None
