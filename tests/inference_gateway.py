"""The chart's Gateway API Inference Extension objects as the tests read them: the InferencePool's API
(inference.networking.k8s.io/v1) as a JSON schema, and the endpoint picker's configuration.

The schema is written from the API's Go types (kubernetes-sigs/gateway-api-inference-extension,
api/v1/inferencepool_types.go and shared_types.go): the spec's fields, their required ones, enums,
bounds and name patterns, and nothing else, so a typo or an unknown field fails as it would against
the CRD with strict field validation. It is what every release of the v1 API accepts, v1.0 to v1.6:
`endpointPickerRef` required (optional only since v1.6) and no `appProtocol` (new in v1.4; left out,
a pool speaks HTTP/1.1). Only the spec: the status is the gateway's.
"""

from __future__ import annotations

import re

import yaml

POOL_API_VERSION = "inference.networking.k8s.io/v1"

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_PORT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}

INFERENCE_POOL_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["selector", "targetPorts", "endpointPickerRef"],
    "properties": {
        "selector": {
            "type": "object",
            "additionalProperties": False,
            "required": ["matchLabels"],
            "properties": {
                "matchLabels": {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": 64,
                    "propertyNames": {"pattern": _LABEL_KEY, "maxLength": 253},
                    "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE, "maxLength": 63},
                }
            },
        },
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
        "endpointPickerRef": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "group": {"type": "string", "maxLength": 253},
                "kind": {
                    "type": "string",
                    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
                    "maxLength": 63,
                },
                "name": {"type": "string", "minLength": 1, "maxLength": 253},
                "port": _PORT,
                "failureMode": {"enum": ["FailOpen", "FailClose"]},
            },
        },
    },
}

INFERENCE_POOL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": POOL_API_VERSION},
        "kind": {"const": "InferencePool"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string", "pattern": _DNS_LABEL, "maxLength": 63},
                "namespace": {"type": "string", "pattern": _DNS_LABEL, "maxLength": 63},
            },
        },
        "spec": INFERENCE_POOL_SPEC,
    },
}

_SPEC = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?\s*$")


def picker_config(docs: list[dict], pool: str, namespace: str) -> dict:
    """The EndpointPickerConfig the pool's endpoint picker is started with: the ConfigMap key its
    --config-file names, in the volume mounted there."""
    deployment = _named(docs, "Deployment", f"{pool}-epp", namespace)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "epp"]
    (path,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--config-file=")]
    directory, key = path.rsplit("/", 1)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = _named(docs, "ConfigMap", volume["configMap"]["name"], namespace)
    return yaml.safe_load(config_map["data"][key])


def plugin_parameters(config: dict, plugin_type: str) -> dict:
    (plugin,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return plugin.get("parameters", {})


def engine_metrics(config: dict) -> dict[str, str]:
    """The metric specs the picker reads from pods of its default engine (field -> PromQL selector)."""
    extractor = plugin_parameters(config, "core-metrics-extractor")
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    return {k: v for k, v in engine.items() if k.endswith("Spec")}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`name{label=value,...}` (an instant selector; quotes optional) -> (name, labels)."""
    match = _SPEC.match(spec)
    assert match, f"not a metric selector: {spec!r}"
    labels = {}
    for pair in filter(None, (match.group(2) or "").split(",")):
        key, value = pair.split("=", 1)
        labels[key.strip()] = value.strip().strip('"')
    return match.group(1), labels


def _named(docs: list[dict], kind: str, name: str, namespace: str) -> dict:
    (found,) = [
        d
        for d in docs
        if d["kind"] == kind and d["metadata"]["name"] == name and d["metadata"]["namespace"] == namespace
    ]
    return found
