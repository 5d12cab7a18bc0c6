"""The manager's decode fast path leaves the cache exactly as the general path would.

tests/engine/test_decode_fast_path.py compares what a whole run emits; this compares the
state itself, call by call: before each ``_allocate_decode_slot`` the manager and request
are copied, and when the fast path takes the call the copy runs the general path
(``allocate_slots`` with the fast path off). Every field reachable from the two
(tables, keyed counts, Mamba request states, queued writes and copies, pool blocks and
keys, stats, pending events, the request's hashes) must then be equal. A call the fast
path refuses must have changed nothing.

It patches and copies the manager's class, so it runs on the Python sources of the cache
(``source_modules``: under a compiled install, in a subprocess; tests/test_compiled.py
holds the compiled modules to the sources).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvtrace.cache import KVCacheManager
from kvtrace.engine import Engine
from tests.engine.test_decode_fast_path import _cases

SMALL = ("hybrid-all-on", "hybrid-dense-retention", "attention-partial-hits", "attention-swa-mamba")


def _dump(root) -> object:
    """Every field reachable from ``root``, as nested plain values (a repeated object as a
    reference to its first visit; functions and classes left out)."""
    seen: dict[int, int] = {}

    def go(o):
        if o is None or isinstance(o, (int, float, str, bytes)):
            return o
        if callable(o):
            return "<callable>"
        k = id(o)
        if k in seen:
            return ("ref", seen[k])
        seen[k] = len(seen)
        if isinstance(o, np.ndarray):
            return ("ndarray", o.tobytes())
        if isinstance(o, (list, tuple)):
            return (type(o).__name__, [go(x) for x in o])
        if isinstance(o, dict):
            return ("dict", [(go(a), go(b)) for a, b in o.items()])
        if isinstance(o, (set, frozenset)):
            return ("set", sorted(repr(x) for x in o))
        names = [n for c in type(o).__mro__ for n in getattr(c, "__slots__", ())]
        names += list(getattr(o, "__dict__", ()))
        return (type(o).__name__, [(n, go(getattr(o, n))) for n in names
                                   if n not in ("_listeners", "__weakref__") and hasattr(o, n)])

    return go(root)


@pytest.mark.source_modules
@pytest.mark.parametrize("name,engine_preset,work", [c for c in _cases() if c[0] in SMALL],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_fast_decode_leaves_the_general_paths_state(name, engine_preset, work, monkeypatch):
    real = KVCacheManager._allocate_decode_slot
    taken = [0, 0]

    def checked(self, request):
        before = copy.deepcopy((self, request))
        done = real(self, request)
        taken[done] += 1
        if not done:
            assert _dump((self, request)) == _dump(before), "a refused fast path changed the state"
            return done
        mgr, req = before
        mgr.decode_fast_path = False
        res = mgr.allocate_slots(req, 1)
        mgr.decode_fast_path = True
        assert res is not None and not any(res.blocks)
        assert _dump((self, request)) == _dump((mgr, req)), f"step {self.step}, {request.request_id}"
        return done

    monkeypatch.setattr(KVCacheManager, "_allocate_decode_slot", checked)
    Engine(engine_preset, audit_interval=7).run(work, [])
    assert taken[1] > 0 and taken[0] > 0  # both outcomes were checked
