"""docs/architecture.md stays true: every path it names in backticks exists, and every module
of the router (router/src/**/*.rs but its tests*.rs) and of the Python package
(server/pagemill/**/*.py but __init__.py) has a line in its module tables, exactly one.
A new module without a line, or a moved one whose line went stale, fails here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"^[\w.*-]+(/[\w.*-]+)*/?$")


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def path_like(token: str) -> bool:
    """A repository path: a slash inside, no spaces, not a URL route (`/v1/...`) or a flag."""
    return "/" in token and not token.startswith(("/", "-", "$", ".")) and PATH.match(token) is not None


def exists(token: str) -> bool:
    if "*" in token:
        return any(ROOT.glob(token))
    p = ROOT / token
    return p.is_dir() if token.endswith("/") else p.exists()


def tracked(pattern_dir: str, suffix: str) -> list[str]:
    """Files under pattern_dir ending in suffix that git tracks (generated files are not), or
    every such file on disk where this is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", pattern_dir], cwd=ROOT, capture_output=True, text=True, check=True)
        files = [f for f in out.stdout.split() if f.endswith(suffix)]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    return [p.relative_to(ROOT).as_posix() for p in (ROOT / pattern_dir).rglob(f"*{suffix}")
            if "_pb2" not in p.name]  # fmt: skip


def modules() -> list[str]:
    rust = [f for f in tracked("router/src", ".rs") if not Path(f).name.startswith("tests")]
    python = [f for f in tracked("server/pagemill", ".py") if Path(f).name != "__init__.py"]
    return sorted(rust + python)


def table_rows(text: str) -> list[str]:
    """The first cell's path of every table row that starts with one."""
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", text, flags=re.M)]


def test_every_named_path_exists():
    missing = sorted({t for t in backticked(DOC.read_text()) if path_like(t) and not exists(t)})
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_has_a_line():
    named = set(table_rows(DOC.read_text()))
    unnamed = [m for m in modules() if m not in named]
    assert not unnamed, f"modules without a line in docs/architecture.md's tables: {unnamed}"


def test_each_module_has_one_line():
    rows = table_rows(DOC.read_text())
    twice = sorted({r for r in rows if rows.count(r) > 1})
    assert not twice, f"modules with more than one line in docs/architecture.md: {twice}"


def test_the_checks_see_what_they_should():
    assert path_like("router/src/kv/radix.rs") and path_like("server/pagemill/shard/") and path_like("tests/test_*.py")
    assert not path_like("/v1/completions") and not path_like("--max-num-batched-tokens") and not path_like("n")
    assert "router/src/scheduler/step_plan.rs" in modules() and "server/pagemill/shard/model_runner.py" in modules()
    assert "router/src/scheduler/tests.rs" not in modules() and "server/pagemill/__init__.py" not in modules()
