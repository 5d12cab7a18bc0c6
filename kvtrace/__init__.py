"""kvtrace: flight recorder and wind tunnel for hybrid LLM prefix caches."""

from kvtrace import compiled as _compiled

_compiled.install()  # before anything imports the cache: its compiled modules or their sources


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed metadata on first use (not at every start)."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("kvtrace")  # pyproject.toml is the one place the version is written
    except PackageNotFoundError:  # a source tree on sys.path without an install
        value = "0+unknown"
    globals()["__version__"] = value
    return value
