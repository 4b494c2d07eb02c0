"""DPKLClassifier forms the embedding/class-weight differences in bounded row chunks."""

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import gpsd.dpkl.dpkl_classifier as dpkl_classifier
from gpsd.dpkl import DPKLClassifier


class _LargestTensor(TorchFunctionMode):
    """Records the largest number of elements of any tensor a torch function returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _classifier(dtype=torch.float64):
    torch.manual_seed(0)
    clf = DPKLClassifier(
        lambda: nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).to(dtype),
        num_classes=3,
        num_particles=5,
        num_weight_particles=4,
        latent_dim=4,
    )
    clf.lengthscale = 0.8
    return clf


def _naive_log_probabilities(clf, x):
    """log rho^{(j)}_{ic} by loops over weight particles, embedding particles and classes."""
    z = clf.embed(x).detach()  # (m, n, d)
    theta = clf.class_weights.detach()
    q, num_classes, _ = theta.shape
    m = z.shape[0]
    out = torch.empty(q, x.shape[0], num_classes, dtype=x.dtype)
    for j in range(q):
        k = torch.zeros(x.shape[0], num_classes, dtype=x.dtype)
        for c in range(num_classes):
            for ell in range(m):
                k[:, c] += torch.exp(-((z[ell] - theta[j, c]) ** 2).sum(-1) / (2 * 0.64)) / m
        out[j] = (k / k.sum(-1, keepdim=True)).log()
    return out


def test_row_chunks_bound_the_largest_tensor(monkeypatch):
    clf = _classifier()
    x = torch.randn(200, 3, dtype=torch.float64)
    q, m, num_classes, d = 4, 5, 3, 4
    full = q * m * x.shape[0] * num_classes * d  # the unchunked (q, m, n, C, d) differences
    monkeypatch.setattr(dpkl_classifier, "_MAX_DIFFERENCE_ELEMENTS", full // 10, raising=False)
    mode = _LargestTensor()
    with mode:
        got = clf.log_class_probabilities(x)
    assert mode.largest <= full // 10
    torch.testing.assert_close(
        got.detach(), _naive_log_probabilities(clf, x), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 1000])
def test_gradients_do_not_depend_on_the_chunking(monkeypatch, rows_per_chunk):
    clf = _classifier()
    x = torch.randn(23, 3, dtype=torch.float64)
    y = torch.arange(23) % 3

    def grads():
        clf.zero_grad()
        ce, potential = clf.losses(x, y, num_data=23)
        (ce + potential).backward()
        return [p.grad.clone() for p in (clf.class_weights, clf.raw_lengthscale)]

    reference = grads()  # default budget: one chunk
    per_row = 4 * 5 * 3 * 4
    monkeypatch.setattr(dpkl_classifier, "_MAX_DIFFERENCE_ELEMENTS", rows_per_chunk * per_row)
    for g, r in zip(grads(), reference, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)


def test_empty_query_still_gives_an_empty_result():
    clf = _classifier()
    assert clf.predict_proba(torch.zeros(0, 3, dtype=torch.float64)).shape == (0, 3)
