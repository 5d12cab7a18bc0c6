"""Fast constructors for the frozen, slotted event dataclasses of ``kvtrace.cache.events``.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``,
which costs microseconds per event on the hot path. These constructors build the same
instances (same class, same field values, still immutable to callers) by calling the
slot descriptors directly. Positional arguments follow the dataclass field order.
"""

from __future__ import annotations

from dataclasses import fields

from kvtrace.cache import events as _ev


def _make_ctor(cls):
    names = [f.name for f in fields(cls)]
    ns = {"_new": object.__new__, "_cls": cls}
    for i, n in enumerate(names):
        ns[f"_s{i}"] = getattr(cls, n).__set__
    args = ", ".join(names)
    body = "".join(f"    _s{i}(o, {n})\n" for i, n in enumerate(names))
    src = f"def make({args}):\n    o = _new(_cls)\n{body}    return o\n"
    exec(src, ns)  # noqa: S102 - generated from the dataclass's own field names
    make = ns["make"]
    make.__doc__ = f"Build a {cls.__name__} (fields: {args})."
    return make


new_block_published = _make_ctor(_ev.BlockPublished)
new_block_evicted = _make_ctor(_ev.BlockEvicted)
new_block_copied = _make_ctor(_ev.BlockCopied)
new_prefix_lookup = _make_ctor(_ev.PrefixLookup)
new_blocks_freed = _make_ctor(_ev.BlocksFreed)
new_stale_hash_left = _make_ctor(_ev.StaleHashLeft)
