"""Offline real data sets and the papers' synthetic settings."""

from gpsd.data.real import DATASETS, DataSplit, load_arrays, load_dataset
from gpsd.data.toy import (
    damped_sine_regression,
    kernel_reconstruction_inputs,
    sine_classification,
    xsinx_regression,
)

__all__ = [
    "DATASETS",
    "DataSplit",
    "damped_sine_regression",
    "kernel_reconstruction_inputs",
    "load_arrays",
    "load_dataset",
    "sine_classification",
    "xsinx_regression",
]
