"""moetrace's version, declared once (pyproject.toml reads it from here). A leaf module: the run
directory, the plan writer and the CLI name it without importing the package's ``__init__``."""

__version__ = "0.1.0"
