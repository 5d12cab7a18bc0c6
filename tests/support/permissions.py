"""Files and folders a test makes read-only, as an unprivileged user finds them."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


@contextlib.contextmanager
def read_only(monkeypatch, *paths: Path):
    """``paths`` without write permission (files 0444, folders 0555), as an unprivileged user
    finds them; restored after, so pytest can remove them."""
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in paths}
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    if os.geteuid() == 0:  # (root's access() says yes to every write)
        real = os.access

        def access(path, mode, *args, **kwargs):
            if mode & os.W_OK and not stat.S_IMODE(os.stat(path).st_mode) & 0o222:
                return False
            return real(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)
    try:
        yield
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
