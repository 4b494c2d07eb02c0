"""Python floats given to the DPKL setters keep float64 precision in a float64 model.

With the default dtype float32 the setters read 0.7 as a float32 tensor first: a float64 model
then held 0.699999988079071 (an error of 1.2e-8) instead of 0.7.
"""

import torch
from torch import nn

from gpsd.dpkl import DPKLClassifier, RandomFeatureKernel


def test_classifier_lengthscale_setter_keeps_float64_precision():
    torch.set_default_dtype(torch.float32)
    clf = DPKLClassifier(lambda: nn.Linear(3, 2), 3, num_particles=2).double()
    clf.lengthscale = 0.7
    assert clf.lengthscale.dtype == torch.float64
    assert abs(clf.lengthscale.item() - 0.7) < 1e-15  # was 0.699999988079071


def test_random_feature_outputscale_setter_keeps_float64_precision():
    torch.set_default_dtype(torch.float32)
    kernel = RandomFeatureKernel(4, 2).double()
    kernel.outputscale = 0.7
    assert kernel.outputscale.dtype == torch.float64
    assert abs(kernel.outputscale.item() - 0.7) < 1e-15  # was 0.699999988079071
