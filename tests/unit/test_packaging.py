"""The wheel (and so the image) holds every package of the source tree: pyproject.toml
lists them by hand (setuptools' `package-dir` maps `stratamq.broker` to `broker/`), and
a package missing there is missing only in the installed copy: the tests, which import
the source tree, pass, while the image's operator died at import (found on real nodes,
issue 21, when `broker/http` was added)."""

from __future__ import annotations

import tomllib

from harness.processes import REPO


def test_every_source_package_is_in_pyproject() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        root = REPO / folder
        # a folder of modules, with an __init__.py or without (`operator/` has none)
        for module in root.rglob("*.py"):
            relative = module.parent.relative_to(root)
            if "__pycache__" not in relative.parts:
                found.add(".".join([name, *relative.parts]))
    assert found - listed == set(), f"add to pyproject.toml [tool.setuptools] packages: " \
        f"{sorted(found - listed)}"
    assert listed - found == set(), sorted(listed - found)
