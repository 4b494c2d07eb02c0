"""Tests of DPKLClassifier."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import gpsd.dpkl.dpkl_classifier as dpkl_classifier
from gpsd.dpkl import DPKLClassifier, DPKLRegressor, ParticleEnsemble

DT = torch.float64


def _net(d_in=4):
    return lambda: nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, 2)).to(DT)


def _svgd_direction(theta, grad, h):
    """(1/q) sum_l [k(l, i) g_l - d/dtheta_l k(l, i)], k = exp(-|theta_l - theta_i|^2 / h)."""
    q = theta.shape[0]
    out = torch.zeros_like(grad)
    for i in range(q):
        for j in range(q):
            k = math.exp(-float((theta[j] - theta[i]).square().sum()) / h)
            out[i] += k * grad[j] + (2.0 / h) * (theta[j] - theta[i]) * k
    return out / q


def test_the_class_weights_use_a_fixed_bandwidth():
    torch.manual_seed(0)
    x, y = torch.randn(30, 4, dtype=DT), torch.randint(0, 3, (30,))
    clf = DPKLClassifier(_net(), 3, num_particles=3, num_weight_particles=4, bandwidth=0.05)
    ref = copy.deepcopy(clf)
    clf.fit(x, y, num_epochs=1, batch_size=30, lr=1e-3)
    _, potential = ref.losses(x, y, 30)
    (grad,) = torch.autograd.grad(potential, [ref.class_weights])
    theta = ref.class_weights.detach().reshape(4, -1)
    direction = _svgd_direction(theta, grad.reshape(4, -1), 0.05)
    # Adam's first step is lr * g / (|g| + eps) for the transformed gradient g
    expected = theta - 1e-3 * direction / (direction.abs() + 1e-8)
    torch.testing.assert_close(
        clf.class_weights.detach().reshape(4, -1), expected, rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("frozen", ["raw_lengthscale", "class_weights"])
def test_frozen_lengthscale_or_class_weights_are_kept(frozen):
    torch.manual_seed(0)
    x, y = torch.randn(30, 3, dtype=DT), (torch.randn(30) > 0).long()
    clf = DPKLClassifier(_net(3), 2, num_particles=2, num_weight_particles=2)
    getattr(clf, frozen).requires_grad_(False)
    before = {k: v.clone() for k, v in clf.state_dict().items()}
    clf.fit(x, y, num_epochs=2, batch_size=10)
    after = clf.state_dict()
    assert torch.equal(after[frozen], before[frozen])
    others = [k for k in ("raw_lengthscale", "class_weights") if k != frozen]
    assert not torch.equal(after[others[0]], before[others[0]])  # the rest trains


def test_classifier_lengthscale_setter_keeps_float64_precision():
    torch.set_default_dtype(torch.float32)
    clf = DPKLClassifier(lambda: nn.Linear(3, 2), 3, num_particles=2).double()
    clf.lengthscale = 0.7
    assert clf.lengthscale.dtype == torch.float64
    assert abs(clf.lengthscale.item() - 0.7) < 1e-15  # was 0.699999988079071


def _net_bn():
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()


def test_classifier_width_check_leaves_batchnorm_statistics_alone():
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_net_bn, 2, num_particles=2, num_weight_particles=2)
    before = {k: v.clone() for k, v in clf.state_dict().items() if "running" in k}
    p = clf.predict_proba(x[:5])  # runs the one-row width check
    assert torch.isfinite(p).all()
    for k, v in clf.state_dict().items():
        if "running" in k:
            assert torch.equal(v, before[k]), k
    clf.fit(x, y, num_epochs=2, batch_size=20, lr=0.01)  # before: refused in training mode
    assert clf.training and torch.isfinite(clf.predict_proba(x)).all()


def test_classifier_fit_with_batchnorm_and_a_one_row_remainder():
    torch.manual_seed(2)
    x = torch.randn(41, 3, dtype=torch.float64)  # 41 = 20 + 20 + 1
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_net_bn, 2, num_particles=2, num_weight_particles=2)
    # before: "Expected more than 1 value per channel when training" on the third minibatch
    history = clf.fit(x, y, num_epochs=2, batch_size=20, lr=0.01)
    assert len(history["loss"]) == 2 and all(torch.isfinite(torch.tensor(history["loss"])))


def test_minibatches_cover_every_row_once_and_join_a_one_row_remainder():
    from gpsd.dpkl.dpkl_classifier import _minibatches

    perm = torch.randperm(41, generator=torch.Generator().manual_seed(0))
    cases = {(41, 20): [20, 21], (40, 20): [20, 20], (41, 41): [41], (3, 1): [1, 1, 1], (1, 5): [1]}
    for (n, batch_size), sizes in cases.items():
        chunks = _minibatches(perm[:n], batch_size)
        assert [len(c) for c in chunks] == sizes, (n, batch_size)
        assert torch.equal(torch.cat(chunks), perm[:n])


def _net_c(d_in=4, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _blobs(n=60):
    torch.set_default_dtype(torch.float64)
    y = torch.arange(n) % 3
    centres = torch.tensor([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 2.0, 0]])
    return centres[y] + 0.5 * torch.randn(n, 4), y


def test_probabilities_equal_loop():
    x, y = _blobs(10)
    clf = DPKLClassifier(_net_c, 3, num_particles=3, num_weight_particles=2)
    clf.lengthscale = 0.7
    got = clf.log_class_probabilities(x).exp()
    mods = [clf.feature_extractor.particle_module(i) for i in range(3)]
    ref = torch.zeros(2, 10, 3)
    for j in range(2):
        for i in range(10):
            ks = torch.zeros(3)
            for c in range(3):
                for mod in mods:
                    z = mod(x[i])
                    theta = clf.class_weights[j, c]
                    ks[c] += torch.exp(-((z - theta) ** 2).sum() / (2 * 0.49)).detach() / 3
            ref[j, i] = ks / ks.sum()
    torch.testing.assert_close(got.detach(), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(clf.predict_proba(x), ref.mean(0))
    nll = -torch.log(ref.mean(0)[torch.arange(10), y]).mean()
    assert math.isclose(clf.nll(x, y), float(nll), rel_tol=1e-10)


def test_far_points_do_not_give_nan():
    clf = DPKLClassifier(_net_c, 3, num_particles=2)
    clf.lengthscale = 1e-3  # every kernel value underflows in linear space
    p = clf.predict_proba(torch.randn(5, 4) * 10)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(5))


def test_fit_learns_blobs_with_early_stopping():
    x, y = _blobs(90)
    xv, yv = _blobs(30)
    clf = DPKLClassifier(_net_c, 3, num_particles=3, num_weight_particles=3, update="svgd")
    hist = clf.fit(x, y, num_epochs=20, batch_size=16, lr=0.03, val_x=xv, val_y=yv, check_every=5)
    assert len(hist["loss"]) == 20 and len(hist["val_accuracy"]) == 5
    assert hist["loss"][-1] < hist["loss"][0]
    assert clf.accuracy(xv, yv) == max(hist["val_accuracy"])
    assert clf.accuracy(xv, yv) > 0.8


def test_state_dict_roundtrip():
    x, _ = _blobs(8)
    a = DPKLClassifier(_net_c, 3, num_particles=2)
    b = DPKLClassifier(_net_c, 3, num_particles=2)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a.predict_proba(x), b.predict_proba(x))


def test_errors():
    x, y = _blobs(12)
    with pytest.raises(ValueError, match="num_particles"):
        DPKLClassifier(_net_c, 3, num_particles=0)
    with pytest.raises(ValueError, match="num_classes"):
        DPKLClassifier(_net_c, 1)
    clf = DPKLClassifier(lambda: _net_c(4, 3), 3, latent_dim=2)
    with pytest.raises(ValueError, match="latent_dim"):
        clf.predict_proba(x)
    clf = DPKLClassifier(_net_c, 3)
    with pytest.raises(ValueError, match="labels in 0..2"):
        clf.fit(x, y + 1, num_epochs=1)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="x must be finite"):
        clf.fit(bad, y, num_epochs=1)
    with pytest.raises(ValueError, match="features"):
        clf.fit(torch.randn(12, 5), y, num_epochs=1)
    for call in (clf.predict_proba, lambda x: clf.nll(x, y), lambda x: clf.accuracy(x, y)):
        with pytest.raises(ValueError, match="x with 5 features"):
            call(torch.randn(12, 5))
    with pytest.raises(ValueError, match="x must hold at least 1 row"):
        clf.nll(x[:0], y[:0])
    with pytest.raises(ValueError, match="x must hold at least 1 row"):
        clf.accuracy(x[:0], y[:0])
    assert clf.predict_proba(x[:0]).shape == (0, 3)
    for bandwidth in (-2.0, 0.0, float("nan"), "mean", True):
        with pytest.raises(ValueError, match="bandwidth"):
            DPKLClassifier(_net_c, 3, bandwidth=bandwidth)
    for prior_std in (True, 0.0, "1"):  # True was taken as 1.0
        with pytest.raises(ValueError, match="prior_std must be a positive float"):
            DPKLClassifier(_net_c, 3, prior_std=prior_std)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_epochs=-1), "num_epochs must be a non-negative int"),
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(batch_size=-4), "batch_size"),
        (dict(batch_size=8.0), "batch_size"),
        (dict(check_every=0), "check_every must be a positive int"),
        (dict(lr=0.0), "lr must be a positive float"),
        (dict(lr=float("inf")), "lr"),
        (dict(lr=True), "lr must be a positive float"),  # was taken as 1.0
        (dict(lr="0.01"), "lr must be a positive float"),
    ],
)
def test_fit_names_the_bad_argument(kwargs, match):
    # a negative batch_size used to skip every minibatch: "training" that changed nothing
    x, y = _blobs(12)
    clf = DPKLClassifier(_net_c, 3, num_particles=2, num_weight_particles=2)
    with pytest.raises(ValueError, match=match):
        clf.fit(x, y, **kwargs)


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


def _dropout_net(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, d_out))


def _net_v(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


class _NetWithSpareHead(nn.Module):
    """A network whose ``head`` takes no part in the forward pass (a pretrained head, say)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.head = nn.Linear(2, 5)

    def forward(self, x):
        return self.body(x)


def _data(n=24):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


def test_classifier_evaluates_in_eval_mode_and_keeps_the_callers_mode():
    x, _ = _data(30)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_dropout_net, 2, num_particles=3, num_weight_particles=2)
    clf.fit(x, y, num_epochs=2, val_x=x, val_y=y, check_every=1)
    assert clf.training
    p1, p2 = clf.predict_proba(x), clf.predict_proba(x)
    torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    assert clf.nll(x, y) == clf.nll(x, y)
    assert clf.training
    clf.eval()
    with torch.no_grad():
        torch.testing.assert_close(p1, clf(x))
    clf.fit(x, y, num_epochs=1)
    assert not clf.training


def test_classifier_fit_with_a_parameter_the_forward_pass_does_not_use():
    # autograd.grad used to raise "appears to not have been used in the graph"
    x, _ = _data(20)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_NetWithSpareHead, 2, num_particles=3, num_weight_particles=2)
    head = clf.feature_extractor.stacked_parameters()["head.weight"].detach().clone()
    body = clf.feature_extractor.stacked_parameters()["body.weight"].detach().clone()
    clf.fit(x, y, num_epochs=1, batch_size=10, lr=1e-2)
    # the paper's update of a zero gradient is zero: the spare head does not move
    torch.testing.assert_close(clf.feature_extractor.stacked_parameters()["head.weight"], head)
    assert not torch.equal(clf.feature_extractor.stacked_parameters()["body.weight"], body)


def test_classifier_fit_rejects_empty_data_and_names_val_x():
    x, _ = _data(12)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_net_v, 2, num_particles=2, num_weight_particles=2)
    with pytest.raises(ValueError, match="x must hold at least 1 row"):  # was ZeroDivisionError
        clf.fit(x[:0], y[:0], num_epochs=1)
    with pytest.raises(ValueError, match="val_x must hold at least 1 row"):
        clf.fit(x, y, num_epochs=1, val_x=x[:0], val_y=y[:0])
    with pytest.raises(ValueError, match="val_x with 5 features"):
        clf.fit(x, y, num_epochs=1, val_x=torch.randn(4, 5), val_y=y[:4])


def test_integer_types_are_accepted():
    x, y = _data(10)
    clf = DPKLClassifier(
        _net_v,
        np.int64(3),
        num_particles=np.int64(2),
        num_weight_particles=torch.tensor(2),
        latent_dim=np.int32(2),
    )
    assert (clf.num_classes, clf.feature_extractor.num_particles) == (3, 2)
    assert clf.class_weights.shape == (2, 3, 2)
    model = DPKLRegressor(x, y, _net_v, num_particles=np.int64(2), num_random_features=3)
    assert model.num_particles == 2
    with pytest.raises(TypeError, match="num_particles"):
        ParticleEnsemble(_net_v, torch.tensor(2.0))
    with pytest.raises(ValueError, match="num_classes"):
        DPKLClassifier(_net_v, np.int64(1))


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_classifier_lengthscale_must_be_positive_and_finite(value):
    # Before: lengthscale = 0 stored raw -inf and predict_proba returned NaN.
    classifier = DPKLClassifier(lambda: nn.Linear(3, 2), 3, num_particles=2)
    with pytest.raises(ValueError, match="lengthscale must be a positive float"):
        classifier.lengthscale = value
    assert classifier.lengthscale.item() == pytest.approx(1.0)
