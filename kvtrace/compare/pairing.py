"""Which run to compare a run with, and how two runs' settings differ.

A comparison isolates one change only when the two runs replay the same trace, in the same
mode, at the same capacity, and differ in exactly one setting (one behaviour switched, one
retention interval, one cost model ...). ``differences`` lists every setting two stored runs
differ in, from their stored records (``runs.config``, ``runs.behaviours``, ``runs.mode``);
``partner`` picks the default B of a run: the newest run that differs from it in exactly
one setting; ``mismatches`` says what makes a chosen pair not an isolated measurement.

Runs are the dicts of ``kvtrace.store.read.run`` (config, behaviours and summary parsed)
or rows with those fields as JSON text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtrace.metrics import (
    DEFINITIONS_CONFIG_KEY,
    PERCENTILES_CONFIG_KEY,
    backend_label,
    definitions_label,
    recorded_definitions,
    replayed_mode,
)
from kvtrace.names import BEHAVIOURS, shell_path, shell_word

# Flattened config keys that make up a run's capacity (engine: KV blocks per group and the
# groups' block sizes; cache-only: usable blocks of block_size tokens).
_CAPACITY_KEYS = ("cache.num_gpu_blocks", "capacity_blocks", "block_size")


@dataclass(frozen=True, slots=True)
class Difference:
    setting: str  # "mode", "behaviour shared-prefix-pinning", "cache.retention_interval", ...
    a: Any
    b: Any
    kind: str  # definitions | mode | capacity | behaviour | setting

    def __str__(self) -> str:
        return f"{self.setting}: A {_show(self.a)} → B {_show(self.b)}"


def _parsed(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k in sorted(value):
            _flatten(value[k], f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


def behaviours_on(stored: Any) -> list[str] | None:
    """The behaviours a run record has switched on, sorted: it stores a JSON list of their
    names or a ``{name: on}`` object (whose keys include the ones switched off: ``runs`` and
    ``diff`` listed those as on). None where it records none (a collected run)."""
    b = _parsed(stored)
    if isinstance(b, dict):
        return sorted(str(k) for k, on in b.items() if on)
    return sorted(str(x) for x in b) if isinstance(b, list) else None


def _behaviours(run: Mapping[str, Any]) -> set[str]:
    return set(behaviours_on(run.get("behaviours")) or ())


_BACKEND_KEYS = ("backend", "vllm_version", "vllm_commit")


def settings(run: Mapping[str, Any]) -> dict[str, Any]:
    """A run's settings as flat ``key -> value``: its mode and every stored config field
    (behaviours are compared apart, one setting each). The cost model counts as one
    setting (its name; its coefficients when the names agree)."""
    cfg = _parsed(run.get("config"))
    # (a cache-only run's mode names its policy, "cache-only/lru", which its config holds:
    # an LRU run and a Belady run at one capacity differed in mode and policy, never paired)
    # (a replay a collector received: its sender's mode, its spans being the direct run's)
    mode = replayed_mode(run.get("mode"), cfg if isinstance(cfg, dict) else None)
    out: dict[str, Any] = {"mode": mode.partition("/")[0] if isinstance(mode, str) else mode}
    if isinstance(cfg, dict):
        cfg = dict(cfg)
        model = cfg.pop("cost_model", None)
        cache = cfg.get("cache")
        if isinstance(cache, dict):
            cfg["cache"] = {k: v for k, v in cache.items() if k != "behaviours"}
        flat: dict[str, Any] = {}
        _flatten(cfg, "", flat)
        flat.pop("mode", None)
        flat.pop(PERCENTILES_CONFIG_KEY, None)  # (how its latencies are summarised, not how it ran)
        flat.pop(DEFINITIONS_CONFIG_KEY, None)  # (what its numbers mean, not how it ran: ``differences`` says)
        for key in [k for k in flat if k.startswith("sweep.")]:  # which sweep, which point: bookkeeping
            del flat[key]  # (a point's settings are its own keys: two points differed twice, never paired)
        for key in _BACKEND_KEYS:  # one setting: whose cache manager, at which vLLM (they counted three times)
            flat.pop(key, None)
        flat["backend"] = backend_label(mode, cfg)
        if "block_size" in flat and flat["block_size"] is None:
            # a cache-only run at its trace's own block size stores that size in its summary
            # (Compare said "block_size: A 32 → B unset" of a 512-token run)
            summary = _parsed(run.get("summary"))
            flat["block_size"] = summary.get("block_size") if isinstance(summary, dict) else None
        out |= flat
        if isinstance(model, dict):
            out["cost_model"] = json.dumps(model, sort_keys=True)
    return out


def _kind(setting: str) -> str:
    if setting == "mode":
        return "mode"
    if setting in _CAPACITY_KEYS or (setting.startswith("cache.groups[") and setting.endswith(".block_size")):
        return "capacity"
    return "setting"


def differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Difference]:
    """Every setting runs ``a`` and ``b`` differ in: the metric definitions they were recorded
    under (where both are known), mode, capacity, each behaviour switched on in one only, every
    other config field; sorted by kind, then name."""
    sa, sb = settings(a), settings(b)
    out = []
    da, db = (recorded_definitions(r.get("mode"), _parsed(r.get("config"))) for r in (a, b))
    if da is not None and db is not None and da != db:
        out.append(Difference("metric definitions", definitions_label(da), definitions_label(db), "definitions"))
    for key in sorted(set(sa) | set(sb)):
        if sa.get(key) != sb.get(key):
            va, vb = sa.get(key), sb.get(key)
            if key == "cost_model":
                va, vb = _model_name(va), _model_name(vb)
                if va == vb:
                    va, vb = "coefficients A", "coefficients B"
            out.append(Difference(key, va, vb, _kind(key)))
    ba, bb = _behaviours(a), _behaviours(b)
    for name in sorted(ba ^ bb):
        out.append(Difference(f"behaviour {name}", "on" if name in ba else "off", "on" if name in bb else "off",
                              "behaviour"))
    order = {"definitions": -1, "mode": 0, "capacity": 1, "behaviour": 2, "setting": 3}
    return sorted(out, key=lambda d: (order[d.kind], d.setting))


def mismatches(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Difference]:
    """What keeps ``a`` and ``b`` from being one isolated change: a different mode, capacity
    or metric definitions, or more than one setting changed (then every difference). Empty
    for a clean pair (exactly one setting differs, none of them those)."""
    diffs = differences(a, b)
    if len(diffs) == 1 and diffs[0].kind not in ("definitions", "mode", "capacity"):
        return []
    return diffs


def same_trace(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal trace digests (the content), or equal trace sources where a digest is missing."""
    if a.get("trace_digest") and b.get("trace_digest"):
        return a["trace_digest"] == b["trace_digest"]
    return a.get("trace_source") == b.get("trace_source")


def partner(a: Mapping[str, Any], candidates: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The default B for run ``a``: the first of ``candidates`` (newest first) that replays
    the same trace and differs from ``a`` in exactly one setting other than mode and
    capacity; None when there is none."""
    for c in candidates:
        if c.get("run_id") != a.get("run_id") and same_trace(a, c):
            # exactly one: a twin of ``a`` (a study's all-on run beside it) measures no change
            diffs = differences(a, c)
            if len(diffs) == 1 and not mismatches(a, c):
                return c
    return None


def study_command(a: Mapping[str, Any], db: str) -> str:
    """The command that records a run differing from ``a`` in one setting: for an engine
    run, ``kvtrace study`` of a behaviour (the pair: that behaviour off and on); for a
    cache-only run, the other eviction policy at the same capacity."""
    # (a command to paste: paths may hold spaces; a live capture's source is its ZMQ endpoint,
    # no trace: the file its --trace-out wrote is)
    source = a.get("trace_source") if a.get("mode") != "live" else None
    trace = shell_path(source) if source else "TRACE"
    db = shell_path(db)
    cfg = _parsed(a.get("config"))
    cfg = cfg if isinstance(cfg, dict) else {}
    # the first N requests only (a run of the whole trace is another trace, never paired with
    # it): a file's digest says so; a generated workload's digest is of what it generated,
    # the requests its summary counts
    limit = re.search(r":limit=([0-9]+)", str(a.get("trace_digest") or ""))  # (ASCII: as --limit takes them)
    summary = _parsed(a.get("summary"))
    requests = summary.get("requests") if isinstance(summary, dict) else None
    if limit:
        workload_flags = f" --limit {limit.group(1)}"
    elif str(source or "").startswith("gen:") and isinstance(requests, int) and requests > 0:
        workload_flags = f" --limit {requests}"
    else:
        workload_flags = ""
    read_at = re.search(r":trace_block_size=([0-9]+)", str(a.get("trace_digest") or ""))
    if read_at:  # (the file read at its --trace-block-size: at the default its ids count other tokens)
        workload_flags += f" --trace-block-size {read_at.group(1)}"
    seed = cfg.get("seed")  # (a generated workload's: another seed generates other requests)
    if isinstance(seed, int) and not isinstance(seed, bool) and seed:
        workload_flags += f" --seed {seed}"
    if str(replayed_mode(a.get("mode"), cfg) or "").startswith("cache-only"):  # (a collected one's: its sender's)
        # (whole numbers only, as the flags take them: a sender's or a damaged record's text
        # was pasted into the command as it is, "1; rm -rf ~" run as a second command)
        size = f" --block-size {cfg['block_size']}" if _whole(cfg.get("block_size")) else ""
        if not _whole(cfg.get("capacity_blocks")):
            # an unbounded cache evicts nothing, so no policy differs from it: a bounded run of
            # the trace is what falls short of its hit rate
            return f"kvtrace replay {trace} --mode cache-only --capacity-blocks N{size}{workload_flags} --db {db}"
        other = "belady" if cfg.get("policy") != "belady" else "lru"
        return (f"kvtrace replay {trace} --mode cache-only --policy {other} "
                f"--capacity-blocks {cfg['capacity_blocks']}{size}{workload_flags} --db {db}")
    # one of the study's pair is this run (the behaviours it has off stay off, --without), the
    # other this run with the studied one switched: one it has on, else one it has off
    on = _behaviours(a) & set(BEHAVIOURS)  # (kvtrace's names only: a record's "$(rm -rf ~)" was pasted as it was)
    off = [b for b in BEHAVIOURS if b not in on]
    behaviour = next(iter(sorted(on)), off[0] if off else BEHAVIOURS[0])
    flags = f" --preset {shell_word(cfg['preset'])}" if cfg.get("preset") else ""
    flags += "".join(f" --without {b}" for b in off if b != behaviour)
    # what else the run was replayed with, so that the study's all-on run is this one's twin
    cache: dict[str, Any] = cfg["cache"] if isinstance(cfg.get("cache"), dict) else {}
    if cfg.get("backend") not in (None, "kvtrace"):
        flags += f" --backend {shell_word(cfg['backend'])}"
    listed = cache.get("groups")  # (a damaged record's "groups": 5 was a TypeError on the Compare page)
    groups = [g for g in listed if isinstance(g, dict)] if isinstance(listed, list) else []
    sizes = {g.get("block_size") for g in groups}
    if len(sizes) == 1 and isinstance(next(iter(sizes)), int):  # (before the capacity: blocks of this size)
        flags += f" --block-size {next(iter(sizes))}"
    for key, flag in (("num_gpu_blocks", "--capacity-blocks"), ("external_capacity_blocks", "--external-blocks")):
        if isinstance(cache.get(key), int) and not isinstance(cache.get(key), bool):
            flags += f" {flag} {cache[key]}"
    retention = cache.get("retention_interval")
    if any(g.get("type") != "FullAttentionSpec" for g in groups):  # (full attention alone takes none, its default)
        if isinstance(retention, int) and not isinstance(retention, bool):
            flags += f" --retention {retention}"
        elif "retention_interval" in cache and retention is None:  # (kimi-hybrid's default is 0)
            flags += " --retention none"
    if cfg.get("content") is False:
        flags += " --no-content"
    return f"kvtrace study {behaviour} --trace {trace}{flags}{workload_flags} --db {db}"


def _whole(value: Any) -> bool:
    """Whether a record's value is a positive whole number, as a size flag takes it."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _model_name(text: Any) -> Any:
    try:
        return json.loads(text).get("name") if isinstance(text, str) else text
    except (ValueError, AttributeError):
        return text


def _show(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return str(v)
