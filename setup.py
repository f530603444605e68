"""Packaging beyond pyproject.toml (which holds the metadata): which files go into the wheel.

The wheel holds the `moeviz` package and, inside it, the repository's top-level `app/` (the Streamlit app)
and `sample_models/` (the bundled models and their evaluation slices), installed as `moeviz/_app` and
`moeviz/_sample_models`, and of `docs/` only the files the app reads (`DOCS_THE_APP_READS`, as
`moeviz/_docs`); `moeviz.resources.bundled_path` finds them there, or beside the package in a checkout (and
in an editable install). `tests/system/test_packaging.py` checks the wheel's file list.
"""

from setuptools import find_packages, setup

BUNDLED = {  # in the wheel -> in the repo
    "moeviz._app": "app",
    "moeviz._sample_models": "sample_models",
    "moeviz._docs": "docs",
}
# the verdict rule (Load & collapse), the what-if definitions (Deployment), the experts sweep (Learn)
DOCS_THE_APP_READS = ["verdicts.md", "deployment-whatifs.md", "experts-sweep.csv"]
EVERYTHING = ["**/*"]
PACKAGE_DATA = {"moeviz": ["py.typed"]}  # PEP 561: type checkers read moeviz's annotations

setup(
    packages=[*find_packages(include=["moeviz", "moeviz.*"]), *BUNDLED],
    package_dir=BUNDLED,
    package_data={
        **PACKAGE_DATA,
        **{name: DOCS_THE_APP_READS if name == "moeviz._docs" else EVERYTHING for name in BUNDLED},
    },
    exclude_package_data={name: ["**/__pycache__/*", "**/*.pyc", "__pycache__/*"] for name in BUNDLED},
)
