"""Offline helpers for the deployment tests: YAML loading, KubeRay CRD schemas, a small kustomize.

`build()` renders a kustomization with the subset of kustomize the manifests in k8s/ use (resources,
namespace, labels, images, configMapGenerator literals, JSON 6902 and merge patches, `$patch: delete`),
so overlays can be validated without the kustomize binary. It raises on anything it does not know.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = Path(__file__).resolve().parent / "data" / "kuberay"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayJob": "ray.io_rayjobs.yaml"}
KNOWN_KEYS = {
    "apiVersion", "kind", "resources", "namespace", "labels", "images", "patches",
    "configMapGenerator", "generatorOptions",
}


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_docs(path: Path) -> list[dict]:
    """The non-empty YAML documents of a file."""
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.load_all(f, Loader=_Loader) if doc]


@cache
def _crd_schema(kind: str, version: str) -> dict:
    crd = load_docs(KUBERAY / CRD_FILES[kind])[0]
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return served["schema"]["openAPIV3Schema"]
    raise KeyError(f"{CRD_FILES[kind]} has no version {version}")


def strict(schema: dict) -> dict:
    """A copy of an OpenAPI v3 schema where objects with listed properties accept no other keys.

    Kubernetes prunes unknown fields of a CRD silently; this turns them into validation errors.
    """
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@cache
def crd_schema(kind: str, version: str = "v1") -> dict:
    """The strict openAPIV3Schema of a KubeRay kind (RayService, RayJob) from the copied CRDs (shared: do not mutate)."""
    return strict(_crd_schema(kind, version))


@cache
def crd_validator(kind: str, version: str = "v1") -> jsonschema.protocols.Validator:
    """A validator for a KubeRay kind, against its strict CRD schema (the schema itself checked once)."""
    schema = crd_schema(kind, version)
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    validator_class.check_schema(schema)
    return validator_class(schema)


# ---------------------------------------------------------------- kustomize subset

def _matches(resource: dict, target: dict) -> bool:
    group, _, version = resource["apiVersion"].rpartition("/")
    checks = {
        "group": group,
        "version": version,
        "kind": resource["kind"],
        "name": resource["metadata"]["name"],
    }
    return all(checks[key] == value for key, value in target.items() if key in checks)


def _merge(base, patch):
    """RFC 7386 JSON merge patch (what kustomize applies to custom resources)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def _pointer(path: str) -> list:
    if not path.startswith("/"):
        raise ValueError(f"JSON patch path {path!r} must start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _json6902(resource: dict, ops: list[dict]) -> dict:
    resource = copy.deepcopy(resource)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = resource
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "remove":
            del node[key]  # KeyError / IndexError: the path does not exist in the base
        elif op["op"] == "replace":
            node[key]  # replace requires the path to exist
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if key == "-" else key, copy.deepcopy(op["value"]))
            else:
                node[key] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"unsupported JSON patch op {op['op']!r}")
    return resource


def _apply_patch(resources: list[dict], patch, target: dict | None, where: str) -> list[dict]:
    if isinstance(patch, list):
        if target is None:
            raise ValueError(f"{where}: a JSON 6902 patch needs a target")
        selected = [r for r in resources if _matches(r, target)]
    else:
        patch = dict(patch)
        target = target or {
            "kind": patch["kind"],
            "name": patch["metadata"]["name"],
        }
        selected = [r for r in resources if _matches(r, target)]
    if not selected:
        raise ValueError(f"{where}: the patch matches no resource ({target})")
    out = []
    for resource in resources:
        if not any(resource is s for s in selected):
            out.append(resource)
        elif isinstance(patch, list):
            out.append(_json6902(resource, patch))
        elif patch.get("$patch") == "delete":
            continue
        else:
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            body["metadata"] = {k: v for k, v in body.get("metadata", {}).items() if k != "name"}
            out.append(_merge(resource, body))
    return out


def _set_images(node, images: list[dict]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    name, _, tag = container["image"].partition(":")
                    for image in images:
                        if image["name"] == name:
                            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
            else:
                _set_images(value, images)
    elif isinstance(node, list):
        for value in node:
            _set_images(value, images)


def build(directory: Path) -> list[dict]:
    """Render the kustomization in `directory` (the subset described in the module docstring)."""
    kustomization_file = directory / "kustomization.yaml"
    if not kustomization_file.is_file():
        raise FileNotFoundError(f"{directory} has no kustomization.yaml")
    kustomization = load_docs(kustomization_file)[0]
    unknown = set(kustomization) - KNOWN_KEYS
    if unknown:
        raise ValueError(f"{kustomization_file}: fields this renderer does not implement: {sorted(unknown)}")

    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            resources += build(path)
        elif path.is_file():
            resources += load_docs(path)
        else:
            raise FileNotFoundError(f"{kustomization_file}: resource {entry} does not exist")

    options = kustomization.get("generatorOptions", {})
    for generator in kustomization.get("configMapGenerator", []):
        if not options.get("disableNameSuffixHash"):
            raise ValueError(f"{kustomization_file}: name-hash suffixes are not rendered here")
        data = dict(literal.split("=", 1) for literal in generator.get("literals", []))
        resources.append({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": generator["name"]}, "data": data,
        })

    for entry in kustomization.get("patches", []):
        if "path" in entry:
            path = directory / entry["path"]
            if not path.is_file():
                raise FileNotFoundError(f"{kustomization_file}: patch {entry['path']} does not exist")
            docs = load_docs(path)
            patch = docs[0]
            if len(docs) != 1:
                raise ValueError(f"{path}: one patch per file")
        else:
            patch = yaml.safe_load(entry["patch"])
        resources = _apply_patch(resources, patch, entry.get("target"), str(kustomization_file))

    for resource in resources:
        if "namespace" in kustomization:
            resource["metadata"]["namespace"] = kustomization["namespace"]
        for label in kustomization.get("labels", []):
            resource["metadata"].setdefault("labels", {}).update(label["pairs"])
        _set_images(resource, kustomization.get("images", []))
    return resources


def by_kind(resources: list[dict], kind: str) -> list[dict]:
    return [r for r in resources if r["kind"] == kind]


def pod_templates(resource: dict) -> list[dict]:
    """The pod templates of a RayService or RayJob: head, each worker group, the RayJob submitter."""
    cluster = resource["spec"].get("rayClusterConfig") or resource["spec"].get("rayClusterSpec")
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [group["template"] for group in cluster.get("workerGroupSpecs", [])]
    if "submitterPodTemplate" in resource["spec"]:
        templates.append(resource["spec"]["submitterPodTemplate"])
    return templates
