"""User-facing errors: the CLI prints ``str(err)`` as one line and exits non-zero."""


class KVTraceError(Exception):
    """A user error (bad trace line, config key, database). Never shown with a traceback."""


class TraceFormatError(KVTraceError):
    def __init__(self, path: str, line: int | None, what: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {what}")
        self.path, self.line, self.what = path, line, what


class ConfigError(KVTraceError):
    def __init__(self, source: str, key: str, what: str):
        super().__init__(f"{source}: {key}: {what}")
        self.source, self.key, self.what = source, key, what
