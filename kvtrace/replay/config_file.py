"""TOML run configuration (``kvtrace replay --config FILE.toml``).

```toml
preset = "kimi-hybrid"            # optional; the CLI's --preset otherwise

[cache]
num_gpu_blocks = [8192, 2048]     # per group, or one int for all
retention_interval = 0            # "none" | 0 | K tokens
enable_partial_hits = true
num_prefill_checkpoint_blocks = 1
num_speculative_blocks = 0
hash_fn = "sha256_cbor"           # or "xxhash"
external_capacity_blocks = 4096   # second-level tier; omit for none
without = ["shared-prefix-pinning"]

[scheduler]
max_num_batched_tokens = 8192
max_num_seqs = 256
long_prefill_token_threshold = 0
```

Unknown sections and keys are errors naming the file and the key.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtrace.errors import ConfigError

_CACHE_KEYS = {
    "num_gpu_blocks": (int, list),
    "retention_interval": (int, str),
    "enable_partial_hits": (bool,),
    "num_prefill_checkpoint_blocks": (int,),
    "num_speculative_blocks": (int,),
    "hash_fn": (str,),
    "external_capacity_blocks": (int,),
    "without": (list,),
}
_SCHEDULER_KEYS = {
    "max_num_batched_tokens": (int,),
    "max_num_seqs": (int,),
    "long_prefill_token_threshold": (int,),
    "max_model_len": (int,),
    "enable_chunked_prefill": (bool,),
}
_TOP_KEYS = {"preset", "cache", "scheduler"}
MAX_CONFIG_BYTES = 1 << 20


@dataclass(slots=True)
class FileConfig:
    preset: str | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)


def parse_retention(value: Any, source: str = "--retention", key: str = "retention") -> int | None:
    """``none`` -> None (dense), ``0`` -> latest-only, ``K`` -> every K tokens."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise ConfigError(source, key, f"expected none, 0 or a token count K, got {value!r}") from None
    if k < 0 or isinstance(value, bool):
        raise ConfigError(source, key, f"expected none, 0 or a token count K, got {value!r}")
    return k


def _check(section: dict, allowed: dict, path: str, prefix: str) -> dict:
    out = {}
    for key, value in section.items():
        if key not in allowed:
            raise ConfigError(path, f"{prefix}.{key}", f"unknown key; expected one of {sorted(allowed)}")
        types = allowed[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            names = " or ".join(t.__name__ for t in types)
            raise ConfigError(path, f"{prefix}.{key}", f"expected {names}, got {value!r}")
        out[key] = value
    return out


def load_config_file(path: str | Path) -> FileConfig:
    p = str(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(p, "-", "no such file") from None
    except IsADirectoryError:
        raise ConfigError(p, "-", "is a directory; expected a TOML file") from None
    except OSError as e:
        raise ConfigError(p, "-", f"cannot read: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(p, "-", f"larger than {MAX_CONFIG_BYTES:,} bytes; expected a small TOML file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(p, f"line {line}", "not UTF-8 text (is it a TOML file?)") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(p, "-", f"invalid TOML: {e}") from None
    for key in raw:
        if key not in _TOP_KEYS:
            raise ConfigError(p, key, f"unknown key; expected one of {sorted(_TOP_KEYS)}")
    cfg = FileConfig(preset=raw.get("preset"))
    if cfg.preset is not None and not isinstance(cfg.preset, str):
        raise ConfigError(p, "preset", f"expected a preset name, got {cfg.preset!r}")
    for name, allowed in (("cache", _CACHE_KEYS), ("scheduler", _SCHEDULER_KEYS)):
        section = raw.get(name, {})
        if not isinstance(section, dict):
            raise ConfigError(p, name, "expected a table")
        setattr(cfg, name, _check(section, allowed, p, name))
    if "retention_interval" in cfg.cache:
        cfg.cache["retention_interval"] = parse_retention(cfg.cache["retention_interval"], p, "cache.retention_interval")
    if "num_gpu_blocks" in cfg.cache and isinstance(cfg.cache["num_gpu_blocks"], list):
        cfg.cache["num_gpu_blocks"] = tuple(cfg.cache["num_gpu_blocks"])
    return cfg
