"""Sphinx configuration of gpsd's documentation (``python -m sphinx -W -b html docs <out>``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import gpsd  # noqa: E402

project = "gpsd"
author = "the gpsd developers"
copyright = "2026, the gpsd developers"
release = gpsd.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    # MathJax copied into the build (_static/mathjax): the pages render their maths offline
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
]

autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False
# the documented classes derive from torch.nn.Module: its hundreds of members are torch's docs
autodoc_default_options["exclude-members"] = "forward, training, dump_patches, call_super_init"
# members inherited from gpsd's own bases are documented on each class; those of torch, GPyTorch
# and Python's built-in classes are theirs
autodoc_default_options["inherited-members"] = ", ".join(
    [
        "Module",
        "GP",
        "ExactGP",
        "ApproximateGP",
        "Kernel",
        "Mean",
        "Likelihood",
        "_OneDimensionalLikelihood",
        "Distribution",
        "ExpFamilyDistribution",
        "Optimizer",
        "LinearOperator",
        "BaseException",
        "object",
        "tuple",
        "dict",
        "BaseEstimator",
        "RegressorMixin",
        "ClassifierMixin",
        "_MetadataRequester",
        "_HTMLDocumentationLinkMixin",
    ]
)
# scikit-learn writes metadata-routing setters onto every estimator class: its API, not gpsd's
autodoc_default_options["exclude-members"] += (
    ", set_score_request, set_fit_request, set_predict_request, get_metadata_routing"
)
nitpicky = False
exclude_patterns = ["_build"]
templates_path = ["_templates"]
html_theme = "furo"
html_title = f"gpsd {release}"


def _subclass_return_type(app, what, name, obj, options, signature, return_annotation):
    """A method a class inherits and that returns ``self`` (``fit``, annotated with the class
    that defines it, often a private base) shows the documented class as its return type."""
    if what != "method":
        return
    recorded = app.env.current_document.autodoc_annotations.get(name, {})
    owner_name, _, method = name.rpartition(".")
    module_name, _, class_name = owner_name.rpartition(".")
    owner = getattr(sys.modules.get(module_name), class_name, None)
    if "return" not in recorded or not isinstance(owner, type):
        return
    defining = next((c for c in owner.__mro__ if method in vars(c)), owner)
    returned = recorded["return"].lstrip("~").rpartition(".")[2]
    if defining is not owner and returned == defining.__name__:
        recorded["return"] = f"~{owner_name}"


def setup(app):
    # after sphinx.ext.autodoc has recorded the annotations (priority 500)
    app.connect("autodoc-process-signature", _subclass_return_type, priority=900)
