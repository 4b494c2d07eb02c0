"""The documentation site: it builds with warnings as errors, its code runs, its API reference is
complete.

- ``test_sphinx_build``: ``python -m sphinx -W -b html docs <tmp>`` succeeds (skipped without
  sphinx, furo or sphinx-mathjax-offline, the ``docs`` extra).
- ``test_built_pages_load_nothing_from_another_host``: the built pages load their scripts,
  stylesheets and fonts (MathJax included) from the build, so they render offline.
- ``test_code_blocks``: every ``.. code-block:: python`` of the guides and tutorials runs, the
  blocks of one page in order in one namespace, as the page says, and prints the output the
  page shows; the figures it saves exist.
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
    "guide_sklearn.rst",
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


def python_blocks(text: str, language: str = "python") -> list[str]:
    """The bodies of the ``.. code-block:: <language>`` directives of a reST page, dedented."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if re.match(rf"^\s*\.\. code-block:: {language}\s*$", lines[i]):
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


# warnings a page's code provokes on purpose, and says so in its text: page -> message patterns
EXPECTED_WARNINGS = {
    # the backends compared on the guide's 10 points, where lanczos and cg say dense is better
    "guide_regression.rst": [r"backend='(lanczos|cg)' on a slowly decaying spectrum"],
}


@pytest.mark.parametrize("page", EXECUTED_PAGES)
def test_code_blocks(page, tmp_path, monkeypatch, capsys):
    """The blocks run in a fresh directory (where they save their figures); what a page shows
    as output (its ``.. code-block:: text`` blocks) is what its code prints."""
    text = (DOCS / page).read_text()
    blocks = python_blocks(text)
    assert blocks, f"{page} has no python code block"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page[:-4]}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for pattern in EXPECTED_WARNINGS.get(page, []):
            warnings.filterwarnings("ignore", message=pattern)
        for number, block in enumerate(blocks, start=1):
            code = compile(block, f"{page} (block {number})", "exec")
            exec(code, namespace)  # noqa: S102 - the documentation's own code
    printed = capsys.readouterr().out
    for shown in python_blocks(text, "text"):
        assert shown in printed, f"{page} shows output its code does not print:\n{shown}"
    for saved in re.findall(r"savefig\(\"([^\"]+)\"", text):
        assert (tmp_path / saved).is_file(), f"{page} does not save {saved}"


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


_DOCS_EXTRA = ("sphinx", "furo", "sphinx-mathjax-offline")
requires_docs_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in _DOCS_EXTRA),
    reason="the docs build needs sphinx, furo and sphinx-mathjax-offline (the docs extra)",
)

# what a page loads: scripts, stylesheets, fonts and other <link>ed resources; CSS url()s
_LOADED = re.compile(
    r"<script\b[^>]*\bsrc=\"([^\"]*)\"|<link\b(?=[^>]*\brel=\"(?:stylesheet|preload|"
    r"modulepreload|icon|shortcut icon|manifest)\")[^>]*\bhref=\"([^\"]*)\"",
)
_CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]+)|@import\s+['\"]([^'\"]+)")


def loaded_resources(html: str) -> list[str]:
    """The addresses an HTML page loads when opened: ``<script src>`` and the ``href`` of
    ``<link>`` elements that fetch (stylesheets, preloads, icons)."""
    return [a or b for a, b in _LOADED.findall(html)]


def is_remote(address: str) -> bool:
    return re.match(r"^(?:[a-z][a-z0-9+.-]*:)?//", address, flags=re.I) is not None


def test_resource_parser_finds_what_a_page_loads():
    page = (
        '<script src="_static/a.js?v=1"></script><script>inline()</script>'
        '<link rel="stylesheet" type="text/css" href="https://cdn.example/x.css" />'
        '<link rel="next" href="next.html"><a href="https://example.org">x</a>'
        '<link rel="preload" href="//fonts.example/f.woff2" as="font">'
    )
    assert loaded_resources(page) == [
        "_static/a.js?v=1",
        "https://cdn.example/x.css",
        "//fonts.example/f.woff2",
    ]
    assert [is_remote(a) for a in loaded_resources(page)] == [False, True, True]
    assert not is_remote("_static/mathjax/tex-chtml.js") and not is_remote("data:font/woff2,")


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory):
    """``python -m sphinx -W -b html docs <tmp>``, once for the tests that read the site."""
    out = tmp_path_factory.mktemp("docs_html")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return out


@requires_docs_extra
def test_sphinx_build(built_docs):
    assert (built_docs / "index.html").exists()
    assert (built_docs / "generated" / "gpsd.DataCentricGPR.html").exists()


@requires_docs_extra
def test_built_pages_load_nothing_from_another_host(built_docs):
    """Offline, every page renders: its scripts, stylesheets and fonts are files of the build,
    MathJax (``_static/mathjax``) included."""
    pages = sorted(built_docs.rglob("*.html"))
    remote = set()
    for page in pages:
        for address in loaded_resources(page.read_text(encoding="utf-8")):
            if is_remote(address):
                remote.add((page.relative_to(built_docs).as_posix(), address))
            else:
                path = (page.parent / address.split("?")[0].split("#")[0]).resolve()
                assert path.is_file(), f"{page.name} loads {address}, which the build lacks"
    for sheet in (built_docs / "_static").rglob("*.css"):
        for a, b in _CSS_URL.findall(sheet.read_text(encoding="utf-8", errors="replace")):
            if is_remote(a or b):
                remote.add((sheet.relative_to(built_docs).as_posix(), a or b))
    assert not remote, f"loaded from another host: {sorted(remote)[:10]}"
    # the maths is typeset by the bundled MathJax, with its fonts
    index = (built_docs / "index.html").read_text(encoding="utf-8")
    assert "_static/mathjax/tex-chtml.js" in loaded_resources(index)
    assert any((built_docs / "_static/mathjax/output/chtml/fonts/woff-v2").glob("*.woff"))


@requires_docs_extra
def test_fit_shows_the_class_it_documents_as_its_return_type(built_docs):
    """``fit`` returns ``self``: where a class inherits it (from a private base, say), its page
    names the class itself as the return type."""
    shown = {}
    for page in (built_docs / "generated").glob("gpsd.*.html"):
        text = page.read_text(encoding="utf-8")
        found = re.search(
            rf'id="{re.escape(page.stem)}\.fit".*?Return type.*?<dd[^>]*>(.*?)</dd>', text, re.S
        )
        if found:
            shown[page.stem] = re.sub(r"<[^>]+>", "", found.group(1)).strip()
    assert {"gpsd.DataCentricGPR", "gpsd.DKLRegressor", "gpsd.ARDGPRegressor"} <= set(shown)
    assert {name: name.rpartition(".")[2] for name in shown} == shown
