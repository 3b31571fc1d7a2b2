"""Every example in docs/api.md, run as written against the real server on the default model.

Python blocks run in document order in one namespace (later examples use the `client`,
`messages` and `tools` of earlier ones); shell blocks run with bash. Only the address is
changed (localhost:3000 -> this server). An example that raises, or a shell command that
fails or answers with an error body, fails the test with the block's text.
"""

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)
ADDRESS = re.compile(r"(localhost|127\.0\.0\.1):3000")


def blocks():
    text = DOC.read_text()
    return [(m.group(1), m.group(2), text[: m.start()].count("\n") + 1) for m in BLOCK.finditer(text)]


def test_docs_have_examples():
    kinds = [k for k, _, _ in blocks()]
    assert kinds.count("python") >= 8 and kinds.count("bash") >= 3, kinds


@pytest.fixture(scope="module")
def namespace():
    return {}


@pytest.mark.parametrize("kind,code,line", blocks(), ids=lambda v: str(v) if isinstance(v, int) else None)
def test_example_runs(kind, code, line, namespace, server):
    code = ADDRESS.sub(server.url.removeprefix("http://"), code)
    if kind == "bash":
        if "pagemill launch" in code or "pip install" in code:
            pytest.skip("starts a server / installs: not an API call")
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"docs/api.md:{line}\n{code}\n{r.stderr}"
        for body in r.stdout.splitlines():
            with contextlib.suppress(ValueError):
                parsed = json.loads(body)
                assert not (isinstance(parsed, dict) and "error" in parsed), f"docs/api.md:{line}: {body}"
        return
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/api.md:{line}", "exec"), namespace)
    except Exception as e:  # the block's text, for the reader of the failure
        pytest.fail(f"docs/api.md:{line} raised {type(e).__name__}: {e}\n{code}")
