"""Every harness script in benchmarks/ (and benchmarks/peers/) still imports and parses its
arguments, so none rots silently: each runs as __main__ with `--help` from outside the
repository (they find it from their own path), quickly, without loading a model."""

from __future__ import annotations

import contextlib
import json
import io
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/peers/*.py")]
                 if not p.name.startswith("_"))  # fmt: skip
SHELL = sorted([*ROOT.glob("benchmarks/peers/*.sh"), *ROOT.glob("scripts/*.sh")])


def _run_help(script: Path) -> tuple[int, str]:
    """Runs `script` as __main__ with `--help` in this process (torch is imported once for all
    of them), as `python script --help` would: its folder first on sys.path. Whatever the script
    adds to sys.path and the sibling modules it imports are undone afterwards."""
    path, modules, argv = list(sys.path), set(sys.modules), sys.argv
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), "--help"]
    out = io.StringIO()
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        sys.path[:], sys.argv = path, argv
        for name in set(sys.modules) - modules:
            f = getattr(sys.modules[name], "__file__", None) or ""
            if f.startswith(str(ROOT / "benchmarks")) or f.startswith(str(ROOT / "integration-tests")):
                del sys.modules[name]
    return code, out.getvalue()


def test_there_are_scripts_to_check():
    names = {p.name for p in SCRIPTS}
    assert {"gpu_sweep.py", "gpu_e2e.py", "paired_burst.py", "refloor.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_parses_its_arguments(script: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repository: the scripts find it from their own path
    code, out = _run_help(script)
    assert code in (0, None) and "usage:" in out, f"{script.relative_to(ROOT)} --help:\n{out}"


@pytest.mark.parametrize("script", ["benchmarks/paired_burst.py", "benchmarks/peers/refloor.py"])
def test_script_runs_as_a_program_from_elsewhere(script: str, tmp_path):
    """The real thing for two of them: `python <script> --help` in its own interpreter, started
    outside the repository (so `import _repo` must come from the script's folder)."""
    done = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "usage:" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_names_no_absolute_checkout(script: Path):
    """Paths come from the script's own location (benchmarks/_repo.py), not from one machine's."""
    text = script.read_text()
    assert "/work/" not in text and "/root/" not in text, f"{script.relative_to(ROOT)} names an absolute checkout"


@pytest.mark.parametrize("script", SHELL, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_script_parses(script: Path):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_repo_paths_come_from_the_file():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _repo
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert _repo.ROOT == ROOT and (_repo.ROOT / "server" / "pagemill").is_dir()
    assert _repo.results("compare-c64") == str(ROOT / "benchmarks" / "results" / "compare-c64")
    assert _repo.results("kv-cache", "kv_cache.json").endswith("benchmarks/results/kv-cache/kv_cache.json")


def test_kernel_ab_swaps_every_binding_and_runs_both_step_kinds(llama_dir, tmp_path):
    """benchmarks/kernel_ab.py on a tiny model with the same library as A and B: it finds the
    kernel bindings the runner holds, swaps them, and times decode and prefill steps."""
    from pagemill.cpu_kernels.build import library

    lib = library()
    if lib is None:
        pytest.skip("no C++ compiler: no kernel library to swap")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernel_ab
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    common = ["--lib-a", lib._name, "--lib-b", lib._name, "--model", llama_dir, "--dtype", "float32", "--threads", "1"]
    out = tmp_path / "ab.json"
    res = kernel_ab.main([*common, "--json", str(out), "decode", "--batch", "2", "--prompt", "8", "--steps", "2"])
    assert res["kernel_bindings_swapped"] > 0 and len(res["ms"]["A"]) == len(res["ms"]["B"]) == 2
    assert json.loads(out.read_text())["what"] == "decode"
    res = kernel_ab.main([*common, "prefill", "--batch", "2", "--prompt", "8", "--reps", "2"])
    assert res["median_ms"]["A"] > 0 and res["median_ms"]["B"] > 0
