"""Every Python block of README.md runs as written (the README is a promise)."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs(index):
    torch.manual_seed(0)
    namespace: dict = {}
    exec(compile(BLOCKS[index], f"README.md block {index + 1}", "exec"), namespace)
