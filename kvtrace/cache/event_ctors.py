"""Fast constructors for the frozen, slotted event dataclasses of ``kvtrace.cache.events``.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``,
which costs microseconds per event on the hot path. These constructors build the same
instances (same class, same field values, still immutable to callers): a private
mutable twin with the same slots runs a plain ``__init__`` (specialised slot stores),
then the instance takes the event's class (allowed: the layouts are identical).
Positional arguments follow the dataclass field order.
"""

from __future__ import annotations

from dataclasses import fields

from kvtrace.cache import events as _ev


def _make_ctor(cls):
    names = [f.name for f in fields(cls)]
    assert tuple(names) == tuple(cls.__slots__), f"{cls.__name__}: slots must be exactly its fields"
    args = ", ".join(names)
    sets = "".join(f"        self.{n} = {n}\n" for n in names)
    src = (
        f"class _Mutable:\n    __slots__ = {tuple(names)!r}\n\n    def __init__(self, {args}):\n{sets}\n\n"
        f"def make({args}):\n    o = _Mutable({args})\n    o.__class__ = _cls\n    return o\n"
    )
    ns = {"_cls": cls}
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
