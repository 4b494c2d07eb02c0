"""The changes that make a closed-form estimator's fit stale, for the estimators' lifecycle tests
(the lifecycle itself is tested in tests/_internal/test_fitted.py)."""

import contextlib

import torch

import gpsd

#: changes that every closed-form estimator refits after
COMMON_TRIGGERS = ["data write", "load_state_dict", "to dtype", "setting"]


def apply_common_trigger(trigger, model, rival, test_x):
    """Make ``trigger``, one of :data:`COMMON_TRIGGERS`, happen to ``model``: a write through
    ``.data`` to the kernel's first parameter, loading the state of ``rival()`` (a model alike at
    other hyperparameters), ``.float()``, or a :mod:`gpsd.settings` value that changes results.

    Returns ``test_x`` in the model's dtype and the context to predict in.
    """
    setting = contextlib.nullcontext()
    if trigger == "data write":
        next(model.covar_module.parameters()).data.add_(0.3)
    elif trigger == "load_state_dict":
        model.load_state_dict(rival().state_dict())
    elif trigger == "to dtype":
        model.float()
        test_x = test_x.float()
    elif trigger == "setting":
        setting = gpsd.settings.dense_max_n(cpu=5)
    else:
        raise ValueError(f"not a common trigger: {trigger!r}")
    return test_x, setting


def predictions_equal(got, want):
    """Assert that two latent predictions are equal to 1e-12."""
    torch.testing.assert_close(got.mean, want.mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.variance, want.variance, rtol=0, atol=1e-12)


def labels_of_classes(x, y, num_classes):
    """``y`` for two classes; for three, labels in 0, 1, 2 from the rank of ``x`` shifted by
    ``y`` (every class present)."""
    if num_classes == 2:
        return y
    rank = torch.argsort(torch.argsort(x))
    return ((rank * 3 // len(x) + y.long()) % 3).to(y.dtype)


def predict_every_way(model, test_x):
    """Every prediction of a stepwise classifier: its probabilities and step targets, and, under
    ``no_grad`` (where a fit made under grad mode must serve too), its latent modes and step 2's
    latent prediction."""
    model.predict_proba(test_x)
    model.step_targets()
    with torch.no_grad():
        model.latent_modes()
        model.predict(test_x, step=2)
