"""The router's import graph (scripts/check_router_deps.py): the real tree
passes, and small synthetic trees show the checker fails on what it must
(a circle of three files, an import running up the layers) and passes what
it must not flag (a circle of two, imports through a mod.rs re-export,
test modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_router_deps.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_router_imports_run_one_way_without_circles():
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert summary.startswith("ok: ") and " 0 circle(s) over two files" in summary, summary
    assert " 0 import(s) running up" in summary, summary


def test_a_circle_of_three_files_fails_and_is_named(tmp_path):
    # One edge each way the checker reads: a grouped `use`, an inline path, a `super::` import with `as`.
    src = tree(tmp_path, {
        "lib.rs": "mod a;\nmod b;\nmod c;\n",
        "a.rs": "use crate::{b::B};\npub struct A;\n",
        "b.rs": "pub struct B;\npub fn f() -> u32 {\n    crate::c::g()\n}\n",
        "c.rs": "use super::a::A as Alias;\npub fn g() -> u32 {\n    let _ = Alias;\n    1\n}\n",
    })
    r = run("--root", str(src), "--no-layers")
    assert r.returncode == 1, r.stdout
    assert "circle of 3 files: a.rs -> b.rs -> c.rs -> a.rs" in r.stdout, r.stdout


def test_a_circle_of_two_files_is_tolerated(tmp_path):
    src = tree(tmp_path, {
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::B;\npub struct A;\n",
        "b.rs": "use crate::a::A;\npub struct B;\n",
    })
    r = run("--root", str(src), "--no-layers")
    assert r.returncode == 0, r.stdout
    assert "0 circle(s) over two files, 1 of two" in r.stdout, r.stdout


def test_an_import_running_up_the_layers_fails(tmp_path):
    src = tree(tmp_path, {
        "lib.rs": "pub mod http;\npub mod kv;\n",
        "http/mod.rs": "pub struct AppState;\n",
        "kv/mod.rs": "use crate::http::AppState;\npub struct KvManager(AppState);\n",
    })
    r = run("--root", str(src))
    assert r.returncode == 1, r.stdout
    assert "kv/mod.rs (kv and shard client) imports http/mod.rs (http), a layer above it" in r.stdout, r.stdout


def test_reexports_resolve_to_the_defining_file_and_test_modules_are_left_out(tmp_path):
    # Through m/mod.rs's re-exports x uses q.rs, not p.rs: no circle x -> m -> p -> x.
    # The test module's import back into p would close one; it is not production code.
    src = tree(tmp_path, {
        "lib.rs": "mod m;\nmod x;\n",
        "m/mod.rs": "mod p;\nmod q;\npub use p::P;\npub use q::Q;\n#[cfg(test)]\nmod tests;\n",
        "m/p.rs": "use crate::x::X;\npub struct P(X);\n",
        "m/q.rs": "pub struct Q;\n#[cfg(test)]\nmod tests {\n    use crate::x::X;\n}\n",
        "m/tests.rs": "use super::p::P;\nuse crate::x::X;\n",
        "x.rs": "use crate::m::Q;\npub struct X(Q);\n",
    })
    r = run("--root", str(src), "--no-layers", "--graph")
    assert r.returncode == 0, r.stdout
    assert "x.rs -> m/q.rs\n" in r.stdout and "m/p.rs -> x.rs\n" in r.stdout, r.stdout
    assert "m/tests.rs" not in r.stdout and "m/q.rs -> -\n" in r.stdout, r.stdout
