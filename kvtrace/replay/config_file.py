"""TOML run configuration (``kvtrace replay --config FILE.toml``).

```toml
preset = "kimi-hybrid"            # optional; a --preset flag overrides it, as a flag does the key it sets

[cache]
num_gpu_blocks = 10240            # the block pool shared by every group, null block included
                                  # (a list, one per group: separate pools, SGLang's layout)
groups = [                        # optional: the KV cache groups (else the preset's)
  { type = "full_attention", block_size = 512 },
  { type = "mamba", block_size = 512, num_lanes = 4 },   # also "sliding_window" (sliding_window = N)
]
hash_block_size = 64
retention_interval = 0            # "none" | 0 | K tokens
enable_partial_hits = true
num_prefill_checkpoint_blocks = 1
prefill_checkpoint_alignment = 16 # FlashKDA; unset: the preset's (kimi-hybrid: 16), else 1 (Mamba2, GDN)
num_speculative_blocks = 0
hash_fn = "sha256_cbor"           # or "xxhash"
external_capacity_blocks = 4096   # second-level tier; omit for none
without = ["shared-prefix-pinning"]  # --without adds to these (both switched off)

[scheduler]
max_num_batched_tokens = 8192
max_num_seqs = 1024
long_prefill_token_threshold = 0
max_model_len = 1048576           # a request longer than this is refused
enable_chunked_prefill = true     # false: a prompt waits for a step whose budget takes it whole (or, with
                                  # a threshold, cut at it while others wait, as vLLM does)
scheduler_reserve_full_isl = true # vLLM's admission gate: a whole sequence must fit to start

[cost_model]                      # a built-in model by name, or one `kvtrace calibrate` wrote
name = "h200-dense-8b"
```

Unknown sections and keys are errors naming the file and the key, and the key it is likely
a typo of (or the section it belongs in).
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtrace.cache.config import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtrace.engine.clock import COEFFICIENTS, COST_MODELS, FITTED_TERMS, CostModel, free_step_problem
from kvtrace.errors import ConfigError, file_problem
from kvtrace.names import BEHAVIOURS, cut_middle, printable
from kvtrace.workload.lines import MAX_TOKENS, compressed_problem, parse_decimal, without_bom

_CACHE_KEYS = {
    "num_gpu_blocks": (int, list),
    "groups": (list,),
    "hash_block_size": (int,),
    "prefill_checkpoint_alignment": (int,),
    "retention_interval": (int, str),
    "enable_partial_hits": (bool,),
    "num_prefill_checkpoint_blocks": (int,),
    "num_speculative_blocks": (int,),
    "hash_fn": (str,),
    "external_capacity_blocks": (int,),
    "without": (list,),
}
_ITEM_TYPES = {"without": str}  # the items of a list value ("groups" are checked by parse_groups)
_SCHEDULER_KEYS = {
    "max_num_batched_tokens": (int,),
    "max_num_seqs": (int,),
    "long_prefill_token_threshold": (int,),
    "max_model_len": (int,),
    "enable_chunked_prefill": (bool,),
    "scheduler_reserve_full_isl": (bool,),  # vLLM's admission gate (default true: a whole sequence must fit)
}
_TOP_KEYS = {"preset", "cache", "scheduler", "cost_model"}
# a section's key -> the section: where a key given in the wrong one (or at the top) belongs
_SECTION_OF = {**dict.fromkeys(_CACHE_KEYS, "cache"), **dict.fromkeys(_SCHEDULER_KEYS, "scheduler"),
               **dict.fromkeys(COEFFICIENTS, "cost_model")}
MAX_CONFIG_BYTES = 1 << 20
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(slots=True)
class FileConfig:
    preset: str | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    cost_model: CostModel | None = None


def parse_retention(value: Any, source: str = "--retention", key: str | None = None) -> int | None:
    """``none`` -> None (dense), ``0`` -> latest-only, ``K`` -> every K tokens. ``key``: the
    file key the value came from (None for the flag ``source``: the value is named)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    k = value if isinstance(value, int) else parse_decimal(value) if isinstance(value, str) else None
    digits = str(value).strip().lstrip("+")
    if (k is not None and k > MAX_TOKENS) or (k is None and digits.isascii() and digits.isdigit()):
        # (a token count all the same: 'expected ... a token count K' said of one was untrue, and one
        # past 2^31 was taken, where every other token count stops there)
        what = f"a token count K of at most {MAX_TOKENS:,} tokens" + (f" ({len(digits):,} digits given)" if k is None
                                                                       else "")
        if key is None:
            raise ConfigError(source, cut_middle(str(value), 80), f"expected none, 0 or {what}")
        raise ConfigError(source, key, f"expected none, 0 or {what}")
    if k is None or k < 0 or isinstance(value, bool):
        if key is None:
            raise ConfigError(source, str(value), "expected none, 0 or a token count K")
        raise ConfigError(source, key, f"expected none, 0 or a token count K, got {value!r}")
    return k


def _named(key: str) -> str:
    """A key from the file as an error names it: quoted unless a plain TOML bare key, so a
    key of spaces or line breaks (which the one-line message would blank) stays visible."""
    return key if _BARE_KEY.fullmatch(key) else repr(key)


# the run flags' own names, written as keys: what each is in a file (its key is vLLM's name)
_FLAG_NAMES = {
    "capacity_blocks": "--capacity-blocks is [cache] num_gpu_blocks here",
    "capacity_tokens": "--capacity-tokens has no key; give [cache] num_gpu_blocks, the pool in blocks",
    "block_size": "--block-size is each [cache] groups entry's block_size here",
    "external_blocks": "--external-blocks is [cache] external_capacity_blocks here",
    "retention": "--retention is [cache] retention_interval here",
}


def _unknown_key(key: str, known: list[str], section: str | None = None) -> str:
    """What an unknown ``key`` of ``section`` (None: the top level) is told: the known key it
    is likely a typo of, or the section it belongs in, before every key that section knows
    (the list alone left a user to spot ``num_gpu_block`` among eleven)."""
    home = _SECTION_OF.get(key)
    if key in _FLAG_NAMES:  # (a flag's name is no typo: "did you mean external_capacity_blocks?" it was)
        hint = f" ({_FLAG_NAMES[key]})"
    elif home is not None and home != section:
        hint = f" here (it belongs in [{home}])"
    else:
        hint = _typo_hint(key, known)
    return f"unknown key{hint}; expected one of {known}"


def _typo_hint(word: object, known: list[str]) -> str:
    """`` (did you mean K?)`` for the known word ``word`` is likely a typo of, else ""."""
    import difflib

    close = difflib.get_close_matches(word, known, n=1, cutoff=0.75) if isinstance(word, str) else []
    return f" (did you mean {close[0]}?)" if close else ""


def _check(section: dict, allowed: dict, path: str, prefix: str) -> dict:
    out = {}
    for key, value in section.items():
        if key not in allowed:
            raise ConfigError(path, f"{prefix}.{_named(key)}", _unknown_key(key, sorted(allowed), prefix))
        types = allowed[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            names = " or ".join(t.__name__ for t in types)
            raise ConfigError(path, f"{prefix}.{key}", f"expected {names}, got {value!r}")
        item = _ITEM_TYPES.get(key)
        if item is not None and not all(isinstance(v, item) for v in value):
            raise ConfigError(path, f"{prefix}.{key}", f"expected a list of {item.__name__}")
        if key == "without":  # (named here: a --without beside it took the blame for the file's name)
            unknown = sorted(set(value) - set(BEHAVIOURS))
            if unknown:
                raise ConfigError(path, f"{prefix}.{key}", f"unknown behaviours {unknown}; known: {sorted(BEHAVIOURS)}")
        out[key] = value
    return out


# Dotted parts of one key at most: tomllib's time and memory grow with the square of a
# key's depth (80 KB of a.a.a... took 53 s and 9 GB); kvtrace's deepest key has three.
MAX_KEY_PARTS = 64


def _check_key_depth(text: str, source: str) -> None:
    """ConfigError naming the line of a key of more than MAX_KEY_PARTS dotted parts (a
    table header's and an inline table's too), found before the parser sees it. A light
    scan of TOML's lexical structure: the dots of keys are counted, not those in strings,
    comments or values (a path, a URL, a float)."""
    if text.count(".") < MAX_KEY_PARTS:  # (every config kvtrace writes: nothing to scan)
        return
    line, parts, in_key = 1, 0, True
    stack: list[str] = []  # open [ of arrays and { of inline tables, innermost last
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            quote = text[i:i + 3] if text[i:i + 3] in ('"""', "'''") else c
            close = text.find(quote, i + len(quote))
            while close != -1 and quote[0] == '"' and _escaped(text, close):
                close = text.find(quote, close + 1)
            close = n if close == -1 else close
            line += text.count("\n", i, close)
            i = close + len(quote)
            continue
        if c == "#":
            i = text.find("\n", i)
            i = n if i == -1 else i
            continue
        if c == "\n":
            line += 1
            if not stack:
                parts, in_key = 0, True
        elif c == "=":
            in_key, parts = False, 0
        elif c == "." and in_key:
            parts += 1
            if parts >= MAX_KEY_PARTS:
                raise ConfigError(source, f"line {line}", f"a key of more than {MAX_KEY_PARTS} dotted parts")
        elif c in "[{":
            if c == "[" and in_key and not stack:  # a table header: its name is a key
                pass
            else:
                stack.append(c)
                in_key = c == "{"
                parts = 0
        elif c in "]}" and stack:
            stack.pop()
        elif c == "," and stack:
            in_key, parts = stack[-1] == "{", 0
        i += 1


def _escaped(text: str, at: int) -> bool:
    """Whether the quote at ``at`` is escaped (an odd run of backslashes before it)."""
    k = at
    while k > 0 and text[k - 1] == "\\":
        k -= 1
    return (at - k) % 2 == 1


def load_config_file(path: str | Path) -> FileConfig:
    p = str(path)
    problem = file_problem(p)  # (a FIFO would block the open)
    if problem is not None:
        raise ConfigError(p, None, f"{problem}; expected a TOML file")
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(p, None, "no such file") from None
    except IsADirectoryError:
        raise ConfigError(p, None, "is a directory; expected a TOML file") from None
    except OSError as e:
        raise ConfigError(p, None, f"cannot read: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(p, None, f"larger than {MAX_CONFIG_BYTES:,} bytes; expected a small TOML file")
    # (UTF-16 text was 'invalid TOML: Invalid initial character for a key part', gzip 'not UTF-8 text')
    problem = compressed_problem(p, data[:12], what="TOML configs")
    if problem is not None:
        raise ConfigError(p, None, problem)
    data = without_bom(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(p, f"line {line}", "not UTF-8 text (is it a TOML file?)") from None
    _check_key_depth(text, p)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(p, None, f"invalid TOML: {e}") from None
    except RecursionError:  # arrays or tables nested deeper than the parser's stack
        raise ConfigError(p, None, "invalid TOML: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        found = re.search("[0-9_]{" + str(sys.get_int_max_str_digits() or 4300) + ",}", text)
        where = f"line {text.count(chr(10), 0, found.start()) + 1}" if found else None
        raise ConfigError(p, where, f"a number too long to read ({e})".splitlines()[0]) from None
    for key in raw:
        if key not in _TOP_KEYS:
            raise ConfigError(p, _named(key), _unknown_key(key, sorted(_TOP_KEYS)))
    cfg = FileConfig(preset=raw.get("preset"))
    if cfg.preset is not None and (not isinstance(cfg.preset, str) or not cfg.preset.strip()):  # ("": no default)
        raise ConfigError(p, "preset", f"expected a preset name, got {cfg.preset!r}")
    for name, allowed in (("cache", _CACHE_KEYS), ("scheduler", _SCHEDULER_KEYS)):
        section = raw.get(name, {})
        if not isinstance(section, dict):
            raise ConfigError(p, name, "expected a table")
        setattr(cfg, name, _check(section, allowed, p, name))
    table = raw.get("cost_model")
    if table is not None:
        if not isinstance(table, dict):
            raise ConfigError(p, "cost_model", "expected a table")
        cfg.cost_model = cost_model_from_table(table, p)
    if "retention_interval" in cfg.cache:
        cfg.cache["retention_interval"] = parse_retention(
            cfg.cache["retention_interval"], p, "cache.retention_interval"
        )
    if "num_gpu_blocks" in cfg.cache and isinstance(cfg.cache["num_gpu_blocks"], list):
        cfg.cache["num_gpu_blocks"] = tuple(cfg.cache["num_gpu_blocks"])
    if "groups" in cfg.cache:
        cfg.cache["groups"] = parse_groups(cfg.cache["groups"], p)
    return cfg


# group type (vLLM's KVCacheSpecKind names) -> (spec class, its keys besides type)
_GROUP_TYPES: dict[str, tuple[type, tuple[str, ...]]] = {
    "full_attention": (FullAttentionSpec, ("block_size",)),
    "sliding_window": (SlidingWindowSpec, ("block_size", "sliding_window")),
    "mamba": (MambaSpec, ("block_size", "num_lanes")),
}


def parse_groups(value: list, source: str) -> tuple:
    """``[cache] groups``: one table per KV cache group (``type`` and its sizes)."""
    if not value:
        raise ConfigError(source, "cache.groups", "expected at least one group table")
    out = []
    for i, g in enumerate(value):
        where = f"cache.groups[{i}]"
        if not isinstance(g, dict):
            raise ConfigError(source, where, f"expected a table like {{ type = \"full_attention\", block_size = 16 }}, "
                                             f"got {g!r}")
        kind = g.get("type")
        if not isinstance(kind, str) or kind not in _GROUP_TYPES:  # (a list or table is no name, nor hashable)
            raise ConfigError(source, f"{where}.type", f"expected one of {sorted(_GROUP_TYPES)}, got {kind!r}"
                                                       f"{_typo_hint(kind, list(_GROUP_TYPES))}")
        cls, keys = _GROUP_TYPES[kind]
        unknown = sorted(set(g) - {"type", *keys})
        if unknown:
            raise ConfigError(source, f"{where}.{_named(unknown[0])}",
                              f"unknown key for {kind}{_typo_hint(unknown[0], list(keys))}; expected {list(keys)}")
        args = {}
        for k in keys:
            v = g.get(k)
            if v is None and k == "num_lanes":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(source, f"{where}.{k}", f"expected a positive int, got {v!r}")
            args[k] = v
        out.append(cls(**args))
    return tuple(out)


def cost_model_from_table(table: dict[str, Any], source: str) -> CostModel:
    """A ``[cost_model]`` table: ``name`` of a built-in model, or every coefficient."""
    unknown = sorted(set(table) - set(COEFFICIENTS) - {"name", "source"})
    if unknown:
        known = ["name", "source", *COEFFICIENTS]
        raise ConfigError(source, f"cost_model.{_named(unknown[0])}", _unknown_key(unknown[0], known, "cost_model"))
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(source, "cost_model.name", "expected the model's name (a string)")
    # Printable, as `kvtrace calibrate --name` requires: every summary, table and diff shows
    # it (an escape sequence in it recoloured the terminal of `kvtrace replay`)
    if not name.strip() or printable(name) != name:
        raise ConfigError(source, "cost_model.name",
                          f"expected a name of printable text, got {cut_middle(repr(name), 80)}")
    if not isinstance(table.get("source", ""), str):
        raise ConfigError(source, "cost_model.source", "expected what the model was fitted to (a string)")
    given = {k: v for k, v in table.items() if k in COEFFICIENTS}
    if not given:
        if name not in COST_MODELS:
            raise ConfigError(source, "cost_model.name", f"{name!r} is not a built-in model ({sorted(COST_MODELS)}); "
                                                          "give its coefficients too")
        return COST_MODELS[name]
    required = ("step_overhead_ns", "token_ns", "attn_pair_ps", "kv_read_ps", "decode_seq_ns")
    missing = [k for k in required if k not in given]
    if missing:
        raise ConfigError(source, f"cost_model.{missing[0]}", "missing (a fitted model gives every coefficient)")
    for k, v in given.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(source, f"cost_model.{k}", f"expected an integer, got {v!r}")
    try:
        model = CostModel(name=name, source=str(table.get("source", source)), **given)
    except ConfigError as err:
        raise ConfigError(source, f"cost_model.{err.key}", err.what) from None
    if model.token_above_knee_ns and not model.token_knee:  # (the term was dropped without a word)
        raise ConfigError(source, "cost_model.token_above_knee_ns",
                          f"{model.token_above_knee_ns:,} has no effect without token_knee (the tokens past which "
                          "it applies; 0 is no knee); give token_knee >= 1, or leave it 0")
    if model.experts_per_token and not model.num_experts:  # (taken and never used: the MoE term needs E)
        raise ConfigError(source, "cost_model.experts_per_token",
                          f"{model.experts_per_token:,} has no effect without num_experts (the MoE term's E, with "
                          "moe_expert_ns); give num_experts >= it, or leave it 0")
    if not any(getattr(model, k) for k in FITTED_TERMS):  # (every TTFT, ITL and E2EL printed 0 ms)
        raise ConfigError(source, "cost_model", f"{name}: every coefficient is 0: each step would take no time and "
                                                "every modelled latency would be 0 (use --mode cache-only for hits "
                                                "alone)")
    problem = free_step_problem(model)
    if problem is not None:
        raise ConfigError(source, "cost_model.step_overhead_ns", f"{problem}; give either >= 1")
    builtin = COST_MODELS.get(name)
    if builtin is not None:  # (a run says which model made its times: one name, one set of coefficients)
        other = next((k for k in COEFFICIENTS if getattr(model, k) != getattr(builtin, k)), None)
        if other is not None:
            raise ConfigError(source, "cost_model.name", f"{name}: is a built-in cost model's name, and its "
                                                         f"{other} is not {getattr(builtin, other):,}; give a fitted "
                                                         "model a name of its own")
        return builtin
    return model
