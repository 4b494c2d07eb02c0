"""The documentation site: it builds with warnings as errors, its code runs, its API reference is
complete.

- ``test_sphinx_build``: ``python -m sphinx -W -b html docs <tmp>`` succeeds (skipped without
  sphinx or furo, the ``docs`` extra).
- ``test_code_blocks``: every ``.. code-block:: python`` of the guides and tutorials runs, the
  blocks of one page in order in one namespace, as the page says.
- ``test_api_reference_covers_every_public_name``: ``docs/api.rst`` names every public name of
  ``gpsd`` and of each subpackage once.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

import gpsd

DOCS = Path(__file__).resolve().parents[1] / "docs"
ROOT = DOCS.parent

# the pages whose python blocks are a script, run in order
EXECUTED_PAGES = [
    "getting_started.rst",
    "guide_regression.rst",
    "guide_classification.rst",
    "guide_kernel_distillation.rst",
    "guide_dpkl.rst",
    "tutorial_training_loop.rst",
    "tutorial_gpu_large_n.rst",
    "tutorial_large_n_training.rst",
    "tutorial_distributed.rst",
    "tutorial_cb_svgp.rst",
]

# the modules whose public names the API reference documents
API_MODULES = [
    "gpsd",
    "gpsd.distillation",
    "gpsd.laplace",
    "gpsd.likelihoods",
    "gpsd.kernels",
    "gpsd.means",
    "gpsd.kernel_distillation",
    "gpsd.dpkl",
    "gpsd.linalg",
    "gpsd.data",
    "gpsd.sklearn",
    "gpsd.settings",
    "gpsd.progress",
    "gpsd.prediction",
    "gpsd.exceptions",
]


def python_blocks(text: str) -> list[str]:
    """The bodies of the ``.. code-block:: python`` directives of a reST page, dedented."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if re.match(r"^\s*\.\. code-block:: python\s*$", lines[i]):
            indent = len(lines[i]) - len(lines[i].lstrip())
            i += 1
            while i < len(lines) and re.match(r"^\s+:\w[\w-]*:", lines[i]):  # options
                i += 1
            body = []
            while i < len(lines) and (
                not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
            ):
                body.append(lines[i])
                i += 1
            blocks.append(textwrap.dedent("\n".join(body)).strip("\n"))
        else:
            i += 1
    return blocks


def test_python_blocks_parser():
    page = ".. code-block:: python\n   :caption: x\n\n    a = 1\n\n    b = a + 1\nText\n"
    assert python_blocks(page) == ["a = 1\n\nb = a + 1"]
    assert python_blocks("::\n\n    a = 1\n") == []


@pytest.mark.parametrize("page", EXECUTED_PAGES)
def test_code_blocks(page):
    blocks = python_blocks((DOCS / page).read_text())
    assert blocks, f"{page} has no python code block"
    namespace: dict = {"__name__": f"docs_{page[:-4]}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for number, block in enumerate(blocks, start=1):
            code = compile(block, f"{page} (block {number})", "exec")
            exec(code, namespace)  # noqa: S102 - the documentation's own code


def _autosummary_sections(text: str) -> dict[str, list[str]]:
    """Module name -> the names its section documents (autosummary entries, ``py:data``)."""
    sections: dict[str, list[str]] = {}
    module = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        found = re.match(r"^\.\. automodule:: ([\w.]+)", line)
        if found:
            module = found.group(1)
            sections.setdefault(module, [])
            continue
        found = re.match(r"^\.\. py:data:: (\w+)", line)
        if found and module:
            sections[module].append(found.group(1))
            continue
        if line.startswith(".. autosummary::") and module:
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith("   ")):
                entry = lines[j].strip()
                if entry and not entry.startswith(":"):
                    sections[module].append(entry)
                j += 1
    return sections


def test_api_reference_covers_every_public_name():
    text = (DOCS / "api.rst").read_text()
    sections = _autosummary_sections(text)
    assert set(sections) == set(API_MODULES)
    top = sections["gpsd"]
    documented: dict[int, str] = {}
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        public = list(module.__all__)
        for name in public:
            obj = getattr(module, name)
            if module_name == "gpsd" and isinstance(obj, types.ModuleType):
                assert f"gpsd.{name}" in sections, f"gpsd.{name} has no section in docs/api.rst"
                continue
            if name in sections[module_name]:
                where = f"{module_name}.{name}"
            else:
                # a re-export of a top-level name: documented under gpsd, linked from its section
                assert getattr(gpsd, name, None) is obj and name in top, (
                    f"{module_name}.{name} is missing from docs/api.rst"
                )
                assert f"<gpsd.{name}>" in text, f"{module_name}.{name} is not linked"
                where = f"gpsd.{name}"
            key = id(obj)
            if isinstance(obj, (type, types.FunctionType)):
                # one description per object
                assert documented.get(key, where) == where, (
                    f"{where} is documented twice (also as {documented[key]})"
                )
                documented[key] = where
    # nothing listed that is not public
    for module_name, names in sections.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert name in module.__all__, f"{module_name}.{name} is not public"


@pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("furo") is None,
    reason="the docs build needs sphinx and furo (the docs extra)",
)
def test_sphinx_build(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(DOCS), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "generated" / "gpsd.DataCentricGPR.html").exists()
