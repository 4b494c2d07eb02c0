"""The shared input conversion: Python numbers are rounded once to the requested dtype."""

import numpy as np
import pytest
import torch

from gpsd._internal.validation import as_float_tensor


def test_python_numbers_are_rounded_once():
    # torch.as_tensor(0.05) is float32: converting it to float64 gave 0.05000000074505806
    assert as_float_tensor(0.05, "v", dtype=torch.float64).item() == 0.05
    got = as_float_tensor([[0.1, 1], (2.5, 1e-300)], "v", dtype=torch.float64)
    want = torch.tensor([[0.1, 1.0], [2.5, 1e-300]], dtype=torch.float64)
    assert torch.equal(got, want)
    assert as_float_tensor(0.1, "v", dtype=torch.float32).item() == np.float32(0.1)


def test_default_dtype_and_array_dtypes_are_kept():
    torch.set_default_dtype(torch.float32)
    assert as_float_tensor(0.05, "v").dtype == torch.float32
    assert as_float_tensor([1, 2], "v").dtype == torch.float32
    assert as_float_tensor(np.zeros(2), "v").dtype == torch.float64
    assert as_float_tensor(torch.zeros(2, dtype=torch.float16), "v").dtype == torch.float16
    assert as_float_tensor(np.float32(0.1), "v", dtype=torch.float64).item() == float(
        np.float32(0.1)
    )


def test_non_numbers_name_the_argument():
    with pytest.raises(TypeError, match="noise must be a tensor or array-like"):
        as_float_tensor(["a"], "noise", dtype=torch.float64)
    with pytest.raises(TypeError, match="noise must"):
        as_float_tensor([1j], "noise", dtype=torch.float64)
    with pytest.raises(TypeError, match="noise must be a tensor or array-like"):
        as_float_tensor(object(), "noise")
