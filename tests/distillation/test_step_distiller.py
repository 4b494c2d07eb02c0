"""The base of every distiller: one ``noise`` check at construction and on assignment, one check
of ``step``, one layout of the per-step tensors and one ``best_step``."""

import numpy as np
import pytest
import torch
from gpr_reference import rbf_kernel
from sklearn.metrics import log_loss

from gpsd import (
    CombinedGPR,
    DataCentricGPC,
    DataCentricGPR,
    DistributionCentricGPC,
    DistributionCentricGPR,
)
from gpsd.distillation._step_distiller import NoiseRule, StepDistiller

DT = torch.float64
LIKE = torch.zeros(3, 1, dtype=DT)


class _Family(StepDistiller):
    """A distiller with a noise schedule checked by ``rule`` and nothing else."""

    def __init__(self, rule: NoiseRule, noise: object, num_steps: object = None) -> None:
        super().__init__()
        self._noise_rule = rule
        self._init_steps(num_steps, noise, LIKE)

    def step_targets(self, step=None):
        return torch.zeros(self.num_steps, 3)


POSITIVE = NoiseRule(positive=True, why="K + noise * I must be invertible")
NONNEGATIVE = NoiseRule(positive=False)


def _data(n=20):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=gen, dtype=DT) * 4
    y = torch.sin(2 * x.squeeze(-1))
    return x, y, (y > 0).to(DT)


@pytest.mark.parametrize(
    ("noise", "num_steps", "expected"),
    [
        (0.5, 3, [0.5, 0.5, 0.5]),
        (0.5, None, [0.5]),
        (torch.tensor(0.5), 2, [0.5, 0.5]),
        (np.float64(0.5), 2, [0.5, 0.5]),
        ([0.1, 0.2], None, [0.1, 0.2]),
        (np.array([0.1, 0.2]), 2, [0.1, 0.2]),
    ],
)
def test_one_value_is_every_steps_and_a_schedule_is_taken_as_given(noise, num_steps, expected):
    model = _Family(POSITIVE, noise, num_steps)
    assert model.noise.dtype == DT and model.noise.tolist() == expected
    assert model.num_steps == len(expected)


def test_a_batch_of_schedules_is_kept():
    batch = torch.full((2, 3), 0.1, dtype=DT)
    assert _Family(POSITIVE, batch, 3).noise.shape == (2, 3)
    assert _Family(NONNEGATIVE, batch).noise.shape == (2, 3)


def test_a_family_that_needs_positive_noise_says_so():
    with pytest.raises(ValueError, match=r"finite numbers > 0 for _Family \(K \+ noise \* I must"):
        _Family(POSITIVE, [0.1, 0.0])
    assert _Family(NONNEGATIVE, [0.1, 0.0]).noise.tolist() == [0.1, 0.0]
    for bad in ([0.1, -0.1], [float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="finite numbers >= 0, got"):
            _Family(NONNEGATIVE, bad)
    with pytest.raises(ValueError, match="empty schedule"):
        _Family(POSITIVE, [])


def test_num_steps_is_fixed_at_construction():
    model = _Family(POSITIVE, 0.5, 3)
    with pytest.raises(AttributeError, match="num_steps is fixed at construction"):
        model.num_steps = 4
    with pytest.raises(ValueError, match="num_steps must be a positive integer"):
        _Family(POSITIVE, 0.5, 0)


FAMILIES = {
    "DataCentricGPR": lambda x, y, lab: DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2, 0.3]),
    "DistributionCentricGPR": lambda x, y, lab: DistributionCentricGPR(
        x, y, rbf_kernel(), noise=[0.1, 0.2, 0.3]
    ),
    "CombinedGPR": lambda x, y, lab: CombinedGPR(x, y, rbf_kernel(), noise=[[0.1, 0.2, 0.3]]),
    "DataCentricGPC": lambda x, y, lab: DataCentricGPC(x, lab, rbf_kernel(), num_steps=3),
}


@pytest.mark.parametrize("make", FAMILIES.values(), ids=FAMILIES.keys())
def test_assigning_noise_is_checked_alike_on_every_family_and_keeps_the_steps(make):
    x, y, labels = _data()
    model = make(x, y, labels)
    model.noise = 0.5  # one number: every step's
    assert model.num_steps == 3 and model.noise.tolist() == [0.5, 0.5, 0.5]
    model.noise = [0.4, 0.3, 0.2]
    assert model.noise.tolist() == [0.4, 0.3, 0.2] and model.noise.dtype == DT
    with pytest.raises(ValueError, match="num_steps=3 does not match the 2 steps.*fixed"):
        model.noise = torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match="finite numbers"):
        model.noise = -1.0
    assert model.noise.tolist() == [0.4, 0.3, 0.2]  # a refused value leaves the schedule
    assert model.num_steps == 3


def test_an_assigned_regression_schedule_predicts_as_one_given_at_construction():
    x, y, _ = _data()
    test_x = torch.linspace(0, 4, 7, dtype=DT).unsqueeze(-1)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="dense")
    with torch.no_grad():
        model.predict(test_x)
        model.noise = torch.full((2, 2), 0.3, dtype=DT)  # a batch of schedules of the same T
        got = model.predict(test_x).mean
        fresh = DataCentricGPR(x, y, rbf_kernel(), noise=[0.3, 0.3], backend="dense")
        torch.testing.assert_close(got, fresh.predict(test_x).mean.expand(2, 2, 7))


def test_an_assigned_batch_of_schedules_that_does_not_broadcast_is_refused_and_undone():
    x, y, _ = _data()
    model = DataCentricGPR(x, y.expand(3, -1), rbf_kernel(), noise=[0.1, 0.2])
    with pytest.raises(ValueError, match="must broadcast"):
        model.noise = torch.full((2, 2), 0.3, dtype=DT)
    assert model.noise.tolist() == [0.1, 0.2]


@pytest.mark.parametrize("labels_batch", [(), (2, 1)])
def test_a_batch_of_classifier_schedules_fits_each_as_its_own_model_would(labels_batch):
    x, _, labels = _data(n=16)
    test_x = torch.linspace(0, 4, 5, dtype=DT).unsqueeze(-1)
    noise = torch.tensor([[0.0, 0.1, 0.3], [0.2, 0.2, 0.5]], dtype=DT)
    members = torch.stack([labels, 1.0 - labels]) if labels_batch else labels.unsqueeze(0)
    given = members.unsqueeze(1) if labels_batch else labels
    model = DataCentricGPC(x, given, rbf_kernel(), num_steps=3, noise=noise)
    with torch.no_grad():
        proba, targets = model.predict_proba(test_x), model.step_targets()
    assert proba.shape == (*labels_batch[:1], 2, 3, 5, 2)  # (*batch, s, T, M, 2)
    assert targets.shape == (*labels_batch[:1], 2, 3, 16)
    for j, member in enumerate(members):
        for i in range(2):
            alone = DataCentricGPC(x, member, rbf_kernel(), num_steps=3, noise=noise[i])
            index = (j, i) if labels_batch else (i,)
            with torch.no_grad():
                torch.testing.assert_close(proba[index], alone.predict_proba(test_x))
            torch.testing.assert_close(targets[index], alone.step_targets())


def test_a_classifier_takes_its_steps_from_the_schedule_as_a_regressor_does():
    x, _, labels = _data()
    model = DataCentricGPC(x, labels, rbf_kernel(), noise=torch.full((2, 3), 0.1))
    assert model.num_steps == 3 and model.noise.shape == (2, 3)
    assert DataCentricGPC(x, labels, rbf_kernel(), noise=[0.0, 0.1, 0.2, 0.3]).num_steps == 4
    assert DataCentricGPC(x, labels, rbf_kernel()).num_steps == 2  # one value: two steps
    assert DataCentricGPC(x, labels, rbf_kernel(), noise=0.1, num_steps=5).num_steps == 5
    with pytest.raises(ValueError, match="num_steps=2 does not match the 3 steps"):
        DataCentricGPC(x, labels, rbf_kernel(), noise=[0.0, 0.1, 0.2], num_steps=2)


def test_a_batch_of_classifier_schedules_is_refused_where_it_cannot_be_fitted():
    x, _, labels = _data()
    with pytest.raises(ValueError, match=r"noise of shape \(3, 2\)\) must broadcast"):
        DataCentricGPC(x, labels.expand(2, -1), rbf_kernel(), num_steps=2, noise=[[0.1] * 2] * 3)
    model = DataCentricGPC(x, labels, rbf_kernel(), num_steps=3)
    with pytest.raises(ValueError, match="refit_hyperparameters=True refits the modules of one"):
        DataCentricGPC(
            x,
            labels,
            rbf_kernel(),
            num_steps=3,
            noise=torch.full((2, 3), 0.1),
            refit_hyperparameters=True,
        )
    model.noise = torch.full((2, 3), 0.1)
    model.refit_hyperparameters = True
    with pytest.raises(ValueError, match="refit_hyperparameters=True refits the modules of one"):
        model.fit()
    model.refit_hyperparameters = False
    model.set_train_data(targets=labels.expand(3, -1), strict=False)  # (3, N) against (2, T)
    with pytest.raises(ValueError, match=r"must broadcast with the batch of the labels"):
        model.fit()
    with pytest.raises(ValueError, match="refit_hyperparameters=True refits"):
        DataCentricGPC(
            x, labels, rbf_kernel(), num_steps=3, refit_hyperparameters=True
        ).noise = torch.full((2, 3), 0.1)


STEPPED = {
    **FAMILIES,
    "DistributionCentricGPC": lambda x, y, lab: DistributionCentricGPC(
        x, lab, rbf_kernel(), num_steps=3
    ),
}


@pytest.mark.parametrize("make", STEPPED.values(), ids=STEPPED.keys())
@pytest.mark.parametrize("bad", [0, 4, True, 1.0])
def test_every_distiller_checks_a_step_alike(make, bad):
    x, y, labels = _data()
    model = make(x, y, labels)
    with pytest.raises(ValueError, match="step must"):
        model.step_targets(bad)


@pytest.mark.parametrize("make", STEPPED.values(), ids=STEPPED.keys())
def test_step_targets_is_a_method_with_the_step_after_the_batch_on_every_distiller(make):
    x, y, labels = _data()
    model = make(x, y, labels)
    with torch.no_grad():
        targets = model.step_targets()
        assert targets.shape == (3, 20)
        for t in (1, 2, 3):
            torch.testing.assert_close(model.step_targets(t), targets[t - 1])
    first = labels if isinstance(model, (DataCentricGPC, DistributionCentricGPC)) else y
    torch.testing.assert_close(targets[0], first)


@pytest.mark.parametrize("cls", [DataCentricGPC, DistributionCentricGPC])
def test_a_batch_of_classification_labels_lays_its_steps_after_the_batch(cls):
    x, _, labels = _data()
    flipped = 1.0 - labels
    batched = cls(x, torch.stack([labels, flipped]), rbf_kernel(), num_steps=3)
    targets, modes = batched.step_targets(), batched.latent_modes()
    assert targets.shape == modes.shape == (2, 3, 20)
    for i, member in enumerate((labels, flipped)):
        single = cls(x, member, rbf_kernel(), num_steps=3)  # fitted on its own
        torch.testing.assert_close(targets[i], single.step_targets(), rtol=1e-8, atol=1e-9)
        torch.testing.assert_close(modes[i], single.latent_modes(), rtol=1e-7, atol=1e-8)
        torch.testing.assert_close(batched.latent_modes(2)[i], single.latent_modes()[1])


def test_the_modes_of_steps_not_kept_are_computed_as_their_predictions_are():
    x, _, labels = _data()
    kept = DistributionCentricGPC(x, labels, rbf_kernel(), num_steps=3, method="tempered")
    last = DistributionCentricGPC(
        x, labels, rbf_kernel(), num_steps=3, method="tempered", store_all_steps=False
    )
    torch.testing.assert_close(last.latent_modes(), kept.latent_modes(), rtol=1e-7, atol=1e-8)


def test_the_accessors_return_copies():
    x, _, labels = _data()
    model = DataCentricGPC(x, labels, rbf_kernel(), num_steps=2)
    before = model.latent_modes().clone()
    model.latent_modes().zero_()
    model.step_targets(1).zero_()
    torch.testing.assert_close(model.latent_modes(), before)
    torch.testing.assert_close(model.step_targets(1), labels)


def test_best_step_of_a_classifier_is_the_step_of_least_validation_log_loss():
    x, _, labels = _data()
    gen = torch.Generator().manual_seed(1)
    val_x = torch.rand(15, 1, generator=gen, dtype=DT) * 4
    val_y = (torch.sin(2 * val_x.squeeze(-1)) > 0).to(DT)
    model = DataCentricGPC(x, labels, rbf_kernel(), num_steps=4, noise=[0.0, 0.5, 1.0, 2.0])
    with torch.no_grad():
        proba = model.predict_proba(val_x)  # shape: (T, M, 2)
    losses = [log_loss(val_y.numpy(), p[:, 1].numpy(), labels=[0, 1]) for p in proba]
    assert model.best_step(val_x=val_x, val_y=val_y) == int(np.argmin(losses)) + 1
    assert model.best_step("validation", val_x=val_x, val_y=val_y) == int(np.argmin(losses)) + 1


def test_best_step_of_a_regressor_defaults_to_gcv_and_names_its_criteria():
    x, y, _ = _data()
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.01, 0.1, 1.0], backend="dense")
    with torch.no_grad():
        assert model.best_step() == int(model.gcv().argmin()) + 1
    with pytest.raises(ValueError, match=r"criterion must be one of \('gcv', 'validation'\)"):
        model.best_step("loo")
    with pytest.raises(ValueError, match="criterion='validation' needs val_x and val_y"):
        model.best_step("validation", val_x=x)
    with pytest.raises(ValueError, match="criterion='gcv' scores the training data"):
        model.best_step("gcv", val_x=x, val_y=y)
    classifier = DataCentricGPC(x, (y > 0).to(DT), rbf_kernel(), num_steps=2)
    with pytest.raises(ValueError, match=r"criterion must be one of \('validation',\)"):
        classifier.best_step("gcv", val_x=x, val_y=(y > 0).to(DT))
    with pytest.raises(ValueError, match="criterion='validation' needs val_x and val_y"):
        classifier.best_step()
