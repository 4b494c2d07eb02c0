"""DPKL models with BatchNorm in the feature extractor: the one-row width checks run in eval mode."""

import torch
from torch import nn

from gpsd.dpkl import DPKLClassifier, DPKLRegressor


def _net():
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()


def test_regressor_with_batchnorm_constructs_fits_and_predicts():
    torch.manual_seed(0)
    x = torch.randn(30, 3, dtype=torch.float64)
    y = torch.sin(x.sum(-1))
    # before: ValueError "train_x ... does not fit the feature extractor: Expected more than 1
    # value per channel when training"
    model = DPKLRegressor(x, y, _net, num_particles=3, num_random_features=20)
    assert model.covar_module.feature_extractor.training  # the check left training mode on
    stats = model.covar_module.feature_extractor.state_dict()
    stats = {k: v.clone() for k, v in stats.items() if "running" in k}
    assert all(torch.equal(v, torch.zeros_like(v)) for k, v in stats.items() if "mean" in k)
    model.fit(num_steps=3, lr=0.01)
    mean, var = model.predict(torch.randn(7, 3, dtype=torch.float64))
    assert torch.isfinite(mean).all() and (var > 0).all()


def test_classifier_width_check_leaves_batchnorm_statistics_alone():
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_net, 2, num_particles=2, num_weight_particles=2)
    before = {k: v.clone() for k, v in clf.state_dict().items() if "running" in k}
    p = clf.predict_proba(x[:5])  # runs the one-row width check
    assert torch.isfinite(p).all()
    for k, v in clf.state_dict().items():
        if "running" in k:
            assert torch.equal(v, before[k]), k
    clf.fit(x, y, num_epochs=2, batch_size=20, lr=0.01)  # before: refused in training mode
    assert clf.training and torch.isfinite(clf.predict_proba(x)).all()


def test_ensemble_batchnorm_statistics_equal_a_loop_over_particles():
    from gpsd.dpkl import ParticleEnsemble

    torch.manual_seed(1)
    ensemble = ParticleEnsemble(_net, 3)
    copies = [ensemble.particle_module(i).train() for i in range(3)]
    x = torch.randn(10, 3, dtype=torch.float64)
    out = ensemble(x)  # training mode: batch statistics, running statistics updated
    for i, module in enumerate(copies):
        torch.testing.assert_close(out[i], module(x))
        updated = ensemble.particle_module(i)[1]
        torch.testing.assert_close(updated.running_mean, module[1].running_mean)
        torch.testing.assert_close(updated.running_var, module[1].running_var)
        assert updated.running_mean.abs().max() > 0


def test_classifier_fit_with_batchnorm_and_a_one_row_remainder():
    torch.manual_seed(2)
    x = torch.randn(41, 3, dtype=torch.float64)  # 41 = 20 + 20 + 1
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_net, 2, num_particles=2, num_weight_particles=2)
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
