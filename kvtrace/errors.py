"""User-facing errors: the CLI prints ``str(err)`` as one line and exits non-zero."""

import math


class KVTraceError(Exception):
    """A user error (bad trace line, config key, database). Never shown with a traceback.

    The message is one line whatever it quotes: line breaks in it (a key or value from a
    hostile file, a library's multi-line text) become spaces."""

    def __init__(self, message: object = "", *args: object):
        text = str(message)
        super().__init__(" ".join(text.splitlines()) if text else text, *args)

    def __reduce__(self):
        # Rebuilt from its message and fields, not by calling __init__ again (a subclass's
        # takes other arguments): an error raised in a sweep's worker process reaches the
        # parent whole, as the one line it is, instead of breaking the process pool.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[KVTraceError], args: tuple, fields: dict) -> KVTraceError:
    err = Exception.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(fields)
    return err


class TraceFormatError(KVTraceError):
    def __init__(self, path: str, line: int | None, what: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {what}")
        self.path, self.line, self.what = path, line, what


class ConfigError(KVTraceError):
    def __init__(self, source: str, key: str, what: str):
        super().__init__(f"{source}: {key}: {what}")
        self.source, self.key, self.what = source, key, what


def check_option(option: str, value: int | float, minimum: int | float,
                 maximum: int | float | None = None) -> int | float:
    """``value`` of a command-line option, refused as one ConfigError naming the option
    unless it is a finite number in [minimum, maximum] (NaN and inf are refused)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(option, str(value), "expected a finite number")
    if value < minimum:
        raise ConfigError(option, str(value), f"expected >= {minimum:,}")
    if maximum is not None and value > maximum:
        raise ConfigError(option, str(value), f"expected at most {maximum:,}")
    return value
