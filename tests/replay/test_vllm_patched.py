"""A patched vLLM (a user's checkout, README "Study your own vLLM patch") that breaks: each
way is one line naming the vLLM file and line and exit 2 (or, in `kvtrace conformance`, a
disagreement), never a traceback, and a replay's run is recorded `failed`.

The patch lives in a file of a stand-in checkout (``CHECKOUT/vllm/v1/core/patch.py``): its
functions replace the real ``KVCacheManager``'s methods, and the loaded API's package root
is that checkout, as it is for an editable install of a user's branch.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace

import pytest

from kvtrace.engine.backends.vllm import _load
from kvtrace.store import read
from tests.cli.support import assert_one_line, run

PATCH = '''\
def raising(self, *args, **kwargs):
    raise RuntimeError("boom in the patch")


def returns_list(self, *args, **kwargs):
    return [1, 2, 3]


def returns_pair(self, request):
    return self.empty_kv_cache_blocks, 0


def returns_none(self, *args, **kwargs):
    return None


def returns_an_unknown_event(self):
    return [object()]
'''
LINE = {"raising": 2, "returns_list": 5, "returns_pair": 9, "returns_none": 13, "returns_an_unknown_event": 17}
REPLAY = ["replay", "gen:mixed", "--limit", "6", "--backend", "vllm", "--no-content"]
CONFORMANCE = ["conformance", "gen:mixed", "--limit", "6"]


@pytest.fixture
def patched(vllm_api, tmp_path, monkeypatch):
    """``patch(method, function)``: the KVCacheManager's method replaced by the patch file's
    function; returns the patch file's path. vLLM's package root is the stand-in checkout."""
    root = tmp_path / "checkout" / "vllm"
    path = root / "v1" / "core" / "patch.py"
    path.parent.mkdir(parents=True)
    path.write_text(PATCH)
    spec = importlib.util.spec_from_file_location("kvtrace_test_vllm_patch", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(_load, "_loaded", replace(vllm_api, root=str(root)))

    def patch(method: str, function: str) -> str:
        monkeypatch.setattr(vllm_api.KVCacheManager, method, getattr(module, function))
        return f"{path}:{LINE[function]}"

    return patch


@pytest.mark.parametrize("method, what", [
    ("__init__", "building KVCacheManager raised RuntimeError: boom in the patch"),
    ("get_computed_blocks", "KVCacheManager.get_computed_blocks for request agent0-s0 raised RuntimeError: boom"),
    ("free", "KVCacheManager.free for request "),
    ("new_step_starts", "KVCacheManager.new_step_starts raised RuntimeError"),
    ("allocate_slots", "failed allocating for request agent0-s0 at step 0: RuntimeError: boom in the patch"),
])
def test_a_patched_method_that_raises_is_one_line_naming_the_file(patched, tmp_path, capsys, method, what):
    # only a ValueError or AssertionError of allocate_slots was caught: any other exception of
    # a patched vLLM (and any at all of its other methods) was a traceback
    where = patched(method, "raising")
    db = tmp_path / "r.duckdb"
    code, _, err = run([*REPLAY, "--db", str(db)], capsys)
    assert_one_line(code, err, what, f"(at {where})")
    assert read.runs(db)["status"].to_list() == ["failed"]
    code, out, err = run(CONFORMANCE, capsys)
    if method == "allocate_slots":  # the managers parted there: a disagreement, shown with where vLLM raised
        assert code == 1 and err == "", err
        assert "vLLM raised RuntimeError: boom in the patch" in out and where in out and "DISAGREE" in out
    else:
        assert_one_line(code, err, what, f"(at {where})")


@pytest.mark.parametrize("method, function, what", [
    ("allocate_slots", "returns_list", "KVCacheManager.allocate_slots returned list [1, 2, 3], expected None or "
                                       "KVCacheBlocks"),
    ("get_computed_blocks", "returns_pair", "KVCacheManager.get_computed_blocks returned tuple"),
    ("take_events", "returns_none", "KVCacheManager.take_events returned NoneType None, expected a list"),
    ("get_block_ids", "returns_none", "KVCacheManager.get_block_ids returned NoneType None"),
])
def test_a_patched_method_that_returns_another_type_is_one_line_naming_the_file(patched, tmp_path, capsys, method,
                                                                                 function, what):
    # a wrong type surfaced as a traceback in kvtrace's scheduler or adapter
    where = patched(method, function).rsplit(":", 1)[0]
    db = tmp_path / "r.duckdb"
    for argv in ([*REPLAY, "--db", str(db)], CONFORMANCE):
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, what, f"(defined at {where}:")
    assert read.runs(db)["status"].to_list() == ["failed"]


def test_an_event_kvtrace_does_not_know_is_refused_not_dropped(patched, tmp_path, capsys):
    # the replay dropped it and completed: a run without what the event said
    patched("take_events", "returns_an_unknown_event")
    db = tmp_path / "r.duckdb"
    for argv in ([*REPLAY, "--db", str(db)], CONFORMANCE):
        code, _, err = run(argv, capsys)
        assert_one_line(code, err, "take_events returned an event of type object, which kvtrace does not know")
    assert read.runs(db)["status"].to_list() == ["failed"]


def test_a_checkout_that_does_not_import_names_the_file_and_line(tmp_path, monkeypatch, capsys):
    # a SyntaxError named the file's base name only, a RuntimeError at import no file at all
    checkout = tmp_path / "checkout"
    (checkout / "fakevllm").mkdir(parents=True)
    (checkout / "fakevllm" / "__init__.py").write_text("")
    (checkout / "fakevllm" / "syntax.py").write_text("x = 1\nclass KVCacheManager(:\n    pass\n")
    (checkout / "fakevllm" / "raises.py").write_text("import os\n\nraise RuntimeError('boom at import')\n")
    (checkout / "fakevllm" / "lacks.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(checkout))
    monkeypatch.setattr(_load, "_package_root", lambda: str(checkout / "fakevllm"))
    cases = {"syntax": ("SyntaxError", f"at {checkout}/fakevllm/syntax.py:2"),
             "raises": ("RuntimeError: boom at import", f"at {checkout}/fakevllm/raises.py:3"),
             "lacks": ("fakevllm.lacks.KVCacheManager not found in", f"{checkout}/fakevllm/lacks.py")}
    for module, (what, where) in cases.items():
        monkeypatch.setattr(_load, "_loaded", None)
        monkeypatch.setitem(_load._API, "KVCacheManager", (f"fakevllm.{module}", "KVCacheManager"))
        sys.modules.pop(f"fakevllm.{module}", None)
        code, _, err = run(["replay", "gen:chat", "--limit", "2", "--backend", "vllm"], capsys)
        assert_one_line(code, err, what, where)


def test_an_editable_checkouts_commit_is_read_under_a_path_with_a_space(tmp_path, monkeypatch):
    # pip writes the checkout's file URL percent-encoded: git ran in ".../my%20vllm", failed,
    # and the run recorded the commit vllm._version was built with, or none, not the checkout's
    import json
    import subprocess

    checkout = tmp_path / "my vllm"
    checkout.mkdir()
    git = ["git", "-C", str(checkout), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (checkout / "f.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "f.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "patch"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()

    class Dist:
        def read_text(self, name):
            url = checkout.as_uri()  # file:///.../my%20vllm
            return json.dumps({"url": url, "dir_info": {"editable": True}}) if name == "direct_url.json" else None

    monkeypatch.setattr(_load.metadata, "distribution", lambda name: Dist())
    assert "%20" in checkout.as_uri()
    assert _load.vllm_commit() == head
    (checkout / "f.py").write_text("x = 2\n")
    assert _load.vllm_commit() == head + "-dirty"
