"""Install the ``services/`` folders under the ``kvmesh`` import name; everything else is in pyproject.toml.

The design fixes the folder layout (``services/frontend``, ``services/router``, ...), but a top-level
``services`` package in site-packages would collide with any other project's. setuptools' package-dir
mapping installs ``services/x/`` as ``kvmesh.x``; the list of packages is derived from the folders so
a new subpackage needs no edit here.
"""

from setuptools import find_packages, setup

setup(
    package_dir={"kvmesh": "services"},
    packages=["kvmesh" + name.removeprefix("services") for name in find_packages(include=["services", "services.*"])],
)
