"""Package layout: one import name, three source folders.

`kernels/` installs as `dspark.kernels` and `drafters/` as `dspark.drafters` (PyPI already has
unrelated `kernels` and `drafters` distributions, so neither may be a top-level name).
"""
from pathlib import Path

from setuptools import setup

ROOTS = {"dspark": "dspark", "dspark.kernels": "kernels", "dspark.drafters": "drafters"}


def _packages():
    packages, package_dir = [], {}
    for name, folder in ROOTS.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder)
            pkg = ".".join([name, *rel.parts]) if rel.parts else name
            packages.append(pkg)
            package_dir[pkg] = str(init.parent)
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir, package_data={"dspark": ["py.typed"]})
