"""The package's one version string: pyproject.toml reads it (``attr:``), ``bert_cluster`` re-exports it.

No imports here: setuptools reads the value from this file's syntax tree without running the package.
"""

__version__ = "0.2.0"
