"""Lints the Dockerfile (no Docker engine here to build it): the rules that
keep the image reproducible, small and safe."""

import re
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def instructions():
    parser = DockerfileParser(fileobj=open(ROOT / "Dockerfile", "rb"))
    return parser.structure


def of(instructions, name):
    return [i["value"] for i in instructions if i["instruction"] == name]


def test_base_images_are_pinned(instructions):
    froms = of(instructions, "FROM")
    assert len(froms) >= 2, "multi-stage: a builder and a runtime stage"
    for f in froms:
        image = f.split()[0]
        assert ":" in image and not image.endswith(":latest"), f"unpinned base image: {image}"
        assert re.search(r":\d", image), f"base tag should be a version: {image}"
    assert "runtime" in froms[-1] and "cuda" in froms[-1], "the final stage runs on a CUDA runtime image"


def test_builder_compiles_the_wheel(instructions):
    runs = " ".join(of(instructions, "RUN"))
    assert "rustup" in runs and "maturin build" in runs and "--locked" in runs


def test_entrypoint_is_exec_form_and_listens_publicly(instructions):
    (entry,) = of(instructions, "ENTRYPOINT")
    assert entry.strip().startswith("["), "ENTRYPOINT must be exec form (signals reach pagemill)"
    assert '"pagemill", "launch"' in entry and '"0.0.0.0"' in entry


def test_expose_matches_the_port(instructions):
    (entry,) = of(instructions, "ENTRYPOINT")
    port = re.search(r'"--port", "(\d+)"', entry).group(1)
    assert of(instructions, "EXPOSE") == [port]


def test_pip_never_caches(instructions):
    for run in of(instructions, "RUN"):
        for cmd in re.split(r"&&|;|\|", run):
            if re.search(r"\bpip\b.*\binstall\b", cmd):
                assert "--no-cache-dir" in cmd, f"pip install without --no-cache-dir: {cmd.strip()}"


def test_apt_lists_are_removed(instructions):
    for run in of(instructions, "RUN"):
        if "apt-get install" in run:
            assert "--no-install-recommends" in run and "rm -rf /var/lib/apt/lists" in run, run


def test_no_remote_add_and_no_latest(instructions):
    for add in of(instructions, "ADD"):
        assert not re.search(r"https?://", add), f"ADD of a URL: {add}"
    assert ":latest" not in (ROOT / "Dockerfile").read_text()


def test_runs_as_non_root(instructions):
    users = of(instructions, "USER")
    assert users and users[-1] not in ("root", "0"), "the final stage must drop root"
