"""Tests of DPKLClassifier: its probabilities, class scores and training steps against loops
over the particles and classes, the convention of fit and predict, and its checks."""

import copy
import io
import math

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from dpkl_reference import tanh_net
from torch import nn
from torch.overrides import TorchFunctionMode

import gpsd
from gpsd.dpkl import DPKLClassifier, DPKLRegressor, ParticleEnsemble
from gpsd.dpkl.dpkl_classifier import _minibatches

DT = torch.float64


def _net_factory(d_in=4):
    return lambda: nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, 2)).to(DT)


def _batchnorm_net():
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()


def _dropout_net(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, d_out))


class _NetWithSpareHead(nn.Module):
    """A network whose ``head`` takes no part in the forward pass (a pretrained head, say)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.head = nn.Linear(2, 5)

    def forward(self, x):
        return self.body(x)


def _blobs(n=60):
    torch.set_default_dtype(torch.float64)
    y = torch.arange(n) % 3
    centres = torch.tensor([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 2.0, 0]])
    return centres[y] + 0.5 * torch.randn(n, 4), y


def _binary(n=24, d=3):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, d)
    return x, (x[:, 0] > 0).long()


def _loop_kernel_means(clf, x, lengthscale):
    """(1/m) sum_l k(g_l(x_i), theta^(j)_c), ``(q, n, C)``, by loops over everything."""
    mods = [
        clf.feature_extractor.particle_module(i) for i in range(clf.feature_extractor.num_particles)
    ]
    q, num_classes, _ = clf.class_weights.shape
    out = torch.zeros(q, x.shape[0], num_classes)
    for j in range(q):
        for i in range(x.shape[0]):
            for c in range(num_classes):
                for mod in mods:
                    z = mod(x[i])
                    theta = clf.class_weights[j, c]
                    out[j, i, c] += torch.exp(
                        -((z - theta) ** 2).sum() / (2 * lengthscale**2)
                    ).detach() / len(mods)
    return out


# ---------------------------------------------------------------------- against loops
def test_probabilities_and_class_scores_equal_loops():
    x, y = _blobs(10)
    clf = DPKLClassifier(x, y, tanh_net, num_particles=3, num_weight_particles=2).fit(max_iter=0)
    clf.lengthscale = 0.7
    k = _loop_kernel_means(clf, x, 0.7)  # shape: (q, n, C)
    ref = k / k.sum(-1, keepdim=True)
    torch.testing.assert_close(
        clf.log_class_probabilities(x).exp().detach(), ref, rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(clf.predict_proba(x), ref.mean(0))
    torch.testing.assert_close(clf.predict(x), ref.mean(0).argmax(-1))
    nll = -torch.log(ref.mean(0)[torch.arange(10), y]).mean()
    assert math.isclose(clf.nll(x, y), float(nll), rel_tol=1e-10)
    latent = clf.predict_latent(x)
    f = k.log()
    torch.testing.assert_close(latent.mean, f.mean(0), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(latent.variance, f.var(0, unbiased=False), rtol=1e-9, atol=1e-12)


def test_far_points_do_not_give_nan():
    x, y = _blobs(6)
    clf = DPKLClassifier(x, y, tanh_net, num_particles=2).fit(max_iter=0)
    clf.lengthscale = 1e-3  # every kernel value underflows in linear space
    p = clf.predict_proba(torch.randn(5, 4) * 10)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(5))
    assert torch.isfinite(clf.predict_latent(torch.randn(5, 4) * 10).mean).all()


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
    clf = DPKLClassifier(
        x, y, _net_factory(), num_particles=3, num_weight_particles=4, bandwidth=0.05
    )
    ref = copy.deepcopy(clf)
    clf.fit(max_iter=1, batch_size=30, lr=1e-3)
    _, potential = ref.losses(x, y, 30)
    (grad,) = torch.autograd.grad(potential, [ref.class_weights])
    theta = ref.class_weights.detach().reshape(4, -1)
    direction = _svgd_direction(theta, grad.reshape(4, -1), 0.05)
    # Adam's first step is lr * g / (|g| + eps) for the transformed gradient g
    expected = theta - 1e-3 * direction / (direction.abs() + 1e-8)
    torch.testing.assert_close(
        clf.class_weights.detach().reshape(4, -1), expected, rtol=0, atol=1e-10
    )


# ---------------------------------------------------------------------- the convention
def test_predicting_before_fit_raises_not_fitted_error():
    x, y = _blobs(9)
    clf = DPKLClassifier(x, y, tanh_net, num_particles=2, num_weight_particles=2)
    for call in (
        lambda: clf.predict_proba(x),
        lambda: clf.predict(x),
        lambda: clf.predict_latent(x),
        lambda: clf.nll(x, y),
        lambda: clf.accuracy(x, y),
        lambda: clf(x),
    ):
        with pytest.raises(gpsd.NotFittedError, match=r"call fit\(\)"):
            call()
    assert clf.fit(max_iter=1) is clf
    assert clf.predict(x).shape == (9,)


def test_prediction_shapes_and_types():
    x, y = _binary(20)
    clf = DPKLClassifier(x, y, tanh_net(3), num_particles=2, num_weight_particles=3).fit(max_iter=2)
    assert clf.num_classes == 2  # inferred from train_y
    xs = torch.randn(7, 3)
    proba = clf.predict_proba(xs)
    assert proba.shape == (7, 2)
    torch.testing.assert_close(proba.sum(-1), torch.ones(7))
    labels = clf.predict(xs)
    assert labels.shape == (7,) and labels.dtype == torch.long
    torch.testing.assert_close(labels, proba.argmax(-1))
    latent = clf.predict_latent(xs)
    assert isinstance(latent, gpsd.Prediction)
    assert latent.mean.shape == (7, 2) and latent.variance.shape == (7, 2)
    assert (latent.variance >= 0).all()
    assert len(clf.history["loss"]) == 2


def test_num_classes_is_inferred_or_given():
    x, y = _binary(12)
    assert DPKLClassifier(x, y, tanh_net(3), num_classes=4).class_weights.shape[1] == 4
    with pytest.raises(ValueError, match="num_classes"):
        DPKLClassifier(x, torch.zeros(12, dtype=torch.long), tanh_net(3))
    with pytest.raises(ValueError, match=r"train_y must hold labels in 0..1"):
        DPKLClassifier(x, y + 1, tanh_net(3), num_classes=2)


def test_one_dimensional_train_x_is_one_feature():
    torch.set_default_dtype(torch.float64)
    x = torch.linspace(-2, 2, 16)
    clf = DPKLClassifier(x, (x > 0).long(), tanh_net(1), num_particles=2).fit(max_iter=1)
    assert clf.train_x.shape == (16, 1)
    assert clf.predict_proba(torch.linspace(-1, 1, 5)).shape == (5, 2)


def test_a_callback_returning_true_stops_fit_after_that_epoch():
    x, y = _binary(20)
    clf = DPKLClassifier(x, y, tanh_net(3), num_particles=2, num_weight_particles=2)
    records = []
    clf.fit(max_iter=10, batch_size=10, callback=lambda r: records.append(r) or r.iteration == 2)
    assert [r.iteration for r in records] == [1, 2]
    assert [r.loss for r in records] == clf.history["loss"]
    assert records[0].task == "DPKLClassifier.fit" and records[0].total == 10


def test_progress_true_shows_a_bar(capsys):
    x, y = _binary(12)
    clf = DPKLClassifier(x, y, tanh_net(3), num_particles=2, num_weight_particles=2)
    clf.fit(max_iter=2, progress=True)
    assert "DPKLClassifier.fit" in capsys.readouterr().err
    tqdm = pytest.importorskip("tqdm")
    bar = tqdm.tqdm(total=2, file=io.StringIO())
    clf.fit(max_iter=2, progress=bar)
    assert bar.n == 2
    bar.close()


def test_fit_learns_blobs_with_early_stopping():
    x, y = _blobs(90)
    xv, yv = _blobs(30)
    clf = DPKLClassifier(x, y, tanh_net, num_particles=3, num_weight_particles=3, update="svgd")
    clf.fit(max_iter=20, batch_size=16, lr=0.03, val_x=xv, val_y=yv, check_every=5)
    hist = clf.history
    assert len(hist["loss"]) == 20 and len(hist["val_accuracy"]) == 5
    assert hist["val_iteration"] == [0, 5, 10, 15, 20] and len(hist["val_nll"]) == 5
    assert hist["loss"][-1] < hist["loss"][0]
    assert clf.accuracy(xv, yv) == max(hist["val_accuracy"])
    assert clf.accuracy(xv, yv) > 0.8


def test_a_trained_state_roundtrips():
    x, y = _blobs(8)
    a = DPKLClassifier(x, y, tanh_net, num_particles=2).fit(max_iter=1)
    b = DPKLClassifier(x, y, tanh_net, num_particles=2)
    b.load_state_dict(a.state_dict())  # a trained state: b is fitted
    torch.testing.assert_close(a.predict_proba(x), b.predict_proba(x))
    assert "train_x" not in a.state_dict()


def test_latent_dim_defaults_to_the_networks_output_width():
    x, y = _blobs(12)
    torch.manual_seed(3)
    inferred = DPKLClassifier(x, y, lambda: tanh_net(4, 5), num_particles=2)
    torch.manual_seed(3)
    given = DPKLClassifier(x, y, lambda: tanh_net(4, 5), num_particles=2, latent_dim=5)
    assert inferred.latent_dim == 5 and inferred.class_weights.shape == (10, 3, 5)
    torch.testing.assert_close(inferred.class_weights, given.class_weights)
    torch.manual_seed(4)
    inferred.fit(max_iter=2)
    torch.manual_seed(4)
    given.fit(max_iter=2)
    torch.testing.assert_close(inferred.predict_proba(x), given.predict_proba(x))
    with pytest.raises(ValueError, match="train_x with 4 features"):
        DPKLClassifier(x, y, lambda: tanh_net(3, 5))


# ---------------------------------------------------------------------- checks
def test_constructor_and_queries_name_the_bad_argument():
    x, y = _blobs(12)
    with pytest.raises(ValueError, match="num_particles"):
        DPKLClassifier(x, y, tanh_net, num_particles=0)
    with pytest.raises(ValueError, match="num_classes"):
        DPKLClassifier(x, y, tanh_net, num_classes=1)
    with pytest.raises(ValueError, match="latent_dim"):
        DPKLClassifier(x, y, lambda: tanh_net(4, 3), latent_dim=2)
    with pytest.raises(ValueError, match="labels in 0..2"):
        DPKLClassifier(x, y + 1, tanh_net, num_classes=3)
    with pytest.raises(ValueError, match="train_y must hold integer class labels"):
        DPKLClassifier(x, y + 0.5, tanh_net)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="train_x must be finite"):
        DPKLClassifier(bad, y, tanh_net)
    with pytest.raises(ValueError, match="train_x with 5 features"):
        DPKLClassifier(torch.randn(12, 5), y, tanh_net)
    clf = DPKLClassifier(x, y, tanh_net).fit(max_iter=0)
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
            DPKLClassifier(x, y, tanh_net, bandwidth=bandwidth)
    for prior_std in (True, 0.0, "1"):  # a bool is not a standard deviation of 1
        with pytest.raises(ValueError, match="prior_std must be a positive float"):
            DPKLClassifier(x, y, tanh_net, prior_std=prior_std)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_iter=-1), "max_iter must be a non-negative int"),
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(batch_size=-4), "batch_size"),  # would skip every minibatch
        (dict(batch_size=8.0), "batch_size"),
        (dict(check_every=0), "check_every must be a positive int"),
        (dict(lr=0.0), "lr must be a positive float"),
        (dict(lr=float("inf")), "lr"),
        (dict(lr=True), "lr must be a positive float"),  # a bool is not a rate of 1
        (dict(lr="0.01"), "lr must be a positive float"),
    ],
)
def test_fit_names_the_bad_argument(kwargs, match):
    x, y = _blobs(12)
    clf = DPKLClassifier(x, y, tanh_net, num_particles=2, num_weight_particles=2)
    with pytest.raises(ValueError, match=match):
        clf.fit(**kwargs)


def test_fit_rejects_empty_data_and_names_val_x():
    x, y = _binary(12)
    with pytest.raises(ValueError, match="train_x must hold at least 1 row"):
        DPKLClassifier(x[:0], y[:0], tanh_net(3), num_classes=2)
    clf = DPKLClassifier(x, y, tanh_net(3), num_particles=2, num_weight_particles=2)
    with pytest.raises(ValueError, match="val_x must hold at least 1 row"):
        clf.fit(max_iter=1, val_x=x[:0], val_y=y[:0])
    with pytest.raises(ValueError, match="val_x with 5 features"):
        clf.fit(max_iter=1, val_x=torch.randn(4, 5), val_y=y[:4])
    with pytest.raises(ValueError, match="val_x and val_y"):
        clf.fit(max_iter=1, val_x=x)


def test_integer_types_are_accepted():
    x, y = _binary(10)
    clf = DPKLClassifier(
        x,
        y,
        tanh_net(3),
        num_classes=np.int64(3),
        num_particles=np.int64(2),
        num_weight_particles=torch.tensor(2),
        latent_dim=np.int32(2),
    )
    assert (clf.num_classes, clf.feature_extractor.num_particles) == (3, 2)
    assert clf.class_weights.shape == (2, 3, 2)
    model = DPKLRegressor(
        x, y.double(), tanh_net(3), num_particles=np.int64(2), num_random_features=3
    )
    assert model.num_particles == 2
    with pytest.raises(TypeError, match="num_particles"):
        ParticleEnsemble(tanh_net(3), torch.tensor(2.0))
    with pytest.raises(ValueError, match="num_classes"):
        DPKLClassifier(x, y, tanh_net(3), num_classes=np.int64(1))


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_lengthscale_must_be_positive_and_finite(value):
    # 0 would be stored as raw -inf, and every probability would be NaN
    x, y = _blobs(6)
    classifier = DPKLClassifier(x[:, :3], y, lambda: nn.Linear(3, 2), num_particles=2)
    with pytest.raises(ValueError, match="lengthscale must be a positive float"):
        classifier.lengthscale = value
    assert classifier.lengthscale.item() == pytest.approx(1.0)


def test_lengthscale_setter_keeps_float64_precision():
    torch.set_default_dtype(torch.float32)
    x, y = torch.randn(6, 3), torch.arange(6) % 3
    clf = DPKLClassifier(x, y, lambda: nn.Linear(3, 2), num_particles=2).double()
    clf.lengthscale = 0.7
    assert clf.lengthscale.dtype == torch.float64
    assert abs(clf.lengthscale.item() - 0.7) < 1e-15  # 0.7 read as float32 is 0.69999998807


def test_takes_the_extractors_dtype_and_a_buffer_only_extractor():
    # the parameters follow the feature extractor (its dtype here, its device on CUDA below),
    # and the data are converted to them
    x, y = torch.randn(6, 3, dtype=torch.float32), torch.arange(6) % 3
    clf = DPKLClassifier(x, y, nn.Linear(3, 2, dtype=torch.float64), num_particles=1)
    assert clf.class_weights.dtype == clf.raw_lengthscale.dtype == torch.float64
    assert clf.train_x.dtype == torch.float64
    x2 = torch.randn(6, 2, dtype=torch.float64)
    buffers_only = DPKLClassifier(
        x2, y, nn.BatchNorm1d(2, affine=False).to(torch.float64), num_particles=2
    ).fit(max_iter=0)
    assert buffers_only.class_weights.dtype == torch.float64
    p = buffers_only.predict_proba(torch.randn(4, 2))
    torch.testing.assert_close(p.sum(-1), torch.ones(4, dtype=torch.float64))


@requires_cuda
def test_on_cuda_keeps_its_parameters_there():
    x, y = torch.randn(6, 3), torch.arange(6) % 3
    classifier = DPKLClassifier(x, y, nn.Linear(3, 2).cuda(), num_particles=2).fit(max_iter=1)
    assert classifier.class_weights.is_cuda and classifier.raw_lengthscale.is_cuda
    assert classifier.predict_proba(torch.randn(4, 3)).is_cuda


# ---------------------------------------------------------------------- training details
@pytest.mark.parametrize("frozen", ["raw_lengthscale", "class_weights"])
def test_frozen_lengthscale_or_class_weights_are_kept(frozen):
    torch.manual_seed(0)
    x, y = torch.randn(30, 3, dtype=DT), (torch.randn(30) > 0).long()
    clf = DPKLClassifier(x, y, _net_factory(3), num_particles=2, num_weight_particles=2)
    getattr(clf, frozen).requires_grad_(False)
    before = {k: v.clone() for k, v in clf.state_dict().items()}
    clf.fit(max_iter=2, batch_size=10)
    after = clf.state_dict()
    assert torch.equal(after[frozen], before[frozen])
    others = [k for k in ("raw_lengthscale", "class_weights") if k != frozen]
    assert not torch.equal(after[others[0]], before[others[0]])  # the rest trains


def test_width_check_leaves_batchnorm_statistics_alone():
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(x, y, _batchnorm_net, num_particles=2, num_weight_particles=2)
    clf.fit(max_iter=0)
    before = {k: v.clone() for k, v in clf.state_dict().items() if "running" in k}
    p = clf.predict_proba(x[:5])  # runs the one-row width check
    assert torch.isfinite(p).all()
    for k, v in clf.state_dict().items():
        if "running" in k:
            assert torch.equal(v, before[k]), k
    clf.fit(max_iter=2, batch_size=20, lr=0.01)  # BatchNorm trains on batches of 20
    assert clf.training and torch.isfinite(clf.predict_proba(x)).all()


def test_fit_with_batchnorm_and_a_one_row_remainder():
    torch.manual_seed(2)
    x = torch.randn(41, 3, dtype=torch.float64)  # 41 = 20 + 20 + 1
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(x, y, _batchnorm_net, num_particles=2, num_weight_particles=2)
    # BatchNorm cannot normalise a minibatch of one row in training mode
    clf.fit(max_iter=2, batch_size=20, lr=0.01)
    loss = clf.history["loss"]
    assert len(loss) == 2 and all(torch.isfinite(torch.tensor(loss)))


def test_minibatches_cover_every_row_once_and_join_a_one_row_remainder():
    perm = torch.randperm(41, generator=torch.Generator().manual_seed(0))
    cases = {(41, 20): [20, 21], (40, 20): [20, 20], (41, 41): [41], (3, 1): [1, 1, 1], (1, 5): [1]}
    for (n, batch_size), sizes in cases.items():
        chunks = _minibatches(perm[:n], batch_size)
        assert [len(c) for c in chunks] == sizes, (n, batch_size)
        assert torch.equal(torch.cat(chunks), perm[:n])


def test_evaluates_in_eval_mode_and_keeps_the_callers_mode():
    x, y = _binary(30)
    clf = DPKLClassifier(x, y, _dropout_net, num_particles=3, num_weight_particles=2)
    clf.fit(max_iter=2, val_x=x, val_y=y, check_every=1)
    assert clf.training
    p1, p2 = clf.predict_proba(x), clf.predict_proba(x)
    torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    assert clf.nll(x, y) == clf.nll(x, y)
    assert clf.training
    clf.eval()
    with torch.no_grad():
        torch.testing.assert_close(p1, clf(x))
    clf.fit(max_iter=1)
    assert not clf.training


def test_fit_with_a_parameter_the_forward_pass_does_not_use():
    # the spare head gets a zero gradient, not an autograd error
    x, y = _binary(20)
    clf = DPKLClassifier(x, y, _NetWithSpareHead, num_particles=3, num_weight_particles=2)
    head = clf.feature_extractor.stacked_parameters()["head.weight"].detach().clone()
    body = clf.feature_extractor.stacked_parameters()["body.weight"].detach().clone()
    clf.fit(max_iter=1, batch_size=10, lr=1e-2)
    # the paper's update of a zero gradient is zero: the spare head does not move
    torch.testing.assert_close(clf.feature_extractor.stacked_parameters()["head.weight"], head)
    assert not torch.equal(clf.feature_extractor.stacked_parameters()["body.weight"], body)


# ---------------------------------------------------------------------- row chunks
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
        torch.randn(6, 3, dtype=dtype),
        torch.arange(6) % 3,
        lambda: nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).to(dtype),
        num_particles=5,
        num_weight_particles=4,
        latent_dim=4,
    )
    clf.lengthscale = 0.8
    return clf.fit(max_iter=0)


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


def test_row_chunks_bound_the_largest_tensor():
    clf = _classifier()
    x = torch.randn(200, 3, dtype=torch.float64)
    q, m, num_classes, d = 4, 5, 3, 4
    full = q * m * x.shape[0] * num_classes * d  # the unchunked (q, m, n, C, d) differences
    mode = _LargestTensor()
    with gpsd.settings.max_chunk_elements(full // 10), mode:
        got = clf.log_class_probabilities(x)
    assert mode.largest <= full // 10
    torch.testing.assert_close(
        got.detach(), _naive_log_probabilities(clf, x), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 1000])
def test_gradients_do_not_depend_on_the_chunking(rows_per_chunk):
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
    with gpsd.settings.max_chunk_elements(rows_per_chunk * per_row):
        chunked = grads()
    for g, r in zip(chunked, reference, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)


def test_empty_query_still_gives_an_empty_result():
    clf = _classifier()
    assert clf.predict_proba(torch.zeros(0, 3, dtype=torch.float64)).shape == (0, 3)
    assert clf.predict(torch.zeros(0, 3, dtype=torch.float64)).shape == (0,)
