"""deploy/k8s/ validated: the core kinds (Deployment, Service) with PyPI
`kubernetes-validate` against Kubernetes' own schemas, strictly (no unknown
field); the InferencePool and InferenceObjective against the OpenAPI schemas of
their published CRDs (vendored in tests/k8s_schemas/: the Gateway API Inference
Extension v1.6.0 and llm-d-router v0.9.0, since CI reaches package registries
only), strictly too; then what ties them together (selectors, ports, probes)."""

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).parent / "k8s_schemas"
KUBERNETES = "1.33.0"  # the oldest release the manifests are checked against; newer ones accept them too


def documents() -> list[dict]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema of the vendored CRDs."""
    out = {}
    for path in SCHEMAS.glob("*.json"):
        crd = json.loads(path.read_text())
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = crd["openAPIV3Schema"]
    return out


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields the structural schema does not declare (the API server would prune them)."""
    if isinstance(value, dict) and "properties" in schema and schema.get("additionalProperties") is None:
        found = [f"{path}.{k}" for k in value if k not in schema["properties"]]
        for k, v in value.items():
            if k in schema["properties"]:
                found += unknown_fields(v, schema["properties"][k], f"{path}.{k}")
        return found
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return [f for k, v in value.items() for f in unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")]
    if isinstance(value, list) and "items" in schema:
        return [f for i, v in enumerate(value) for f in unknown_fields(v, schema["items"], f"{path}[{i}]")]
    return []


def validate(doc: dict) -> None:
    """Raises when `doc` is not a valid object of its kind."""
    crd = crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if crd is None:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        return
    jsonschema.validate(doc, crd)
    extra = unknown_fields(doc, crd)
    if extra:
        raise jsonschema.ValidationError(f"unknown fields: {extra}")


def by_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid(doc):
    validate(doc)


def test_every_kind_is_covered():
    assert {d["kind"] for d in documents()} == {"Deployment", "Service", "InferencePool", "InferenceObjective"}


def test_broken_manifests_are_caught():
    deployment, pool, objective = by_kind("Deployment")[0], by_kind("InferencePool")[0], by_kind("InferenceObjective")[0]
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    no_selector, typo, bad_port = copy.deepcopy(pool), copy.deepcopy(pool), copy.deepcopy(pool)
    del no_selector["spec"]["selector"]
    typo["spec"]["targetPort"] = typo["spec"].pop("targetPorts")
    bad_port["spec"]["targetPorts"][0]["number"] = 70000
    unknown = copy.deepcopy(objective)
    unknown["spec"]["modelName"] = "x"
    for doc in (bad, no_selector, typo, bad_port, unknown):
        with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
            validate(doc)


def test_the_pieces_fit_together():
    deployment = by_kind("Deployment")[0]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    for service in by_kind("Service"):
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    pool = by_kind("InferencePool")[0]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    assert labels.get("llm-d.ai/engine-type") == "vllm"  # the endpoint picker reads the vLLM metric names
    for objective in by_kind("InferenceObjective"):
        assert objective["spec"]["poolRef"] == {"group": "inference.networking.k8s.io", "name": pool["metadata"]["name"]}
