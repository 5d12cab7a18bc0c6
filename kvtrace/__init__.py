"""kvtrace: flight recorder and wind tunnel for hybrid LLM prefix caches."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvtrace")  # pyproject.toml is the one place the version is written
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
