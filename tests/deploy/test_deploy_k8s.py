"""Kubernetes manifests: schemas (core and KubeRay), overlays, cross-references, the retrain RayJob."""

from __future__ import annotations

import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy_manifests import ROOT, build, by_kind, crd_validator, load_docs, pod_templates

# Oldest Kubernetes we support; its schemas ship inside kubernetes-validate (no network needed).
K8S_VERSION = "1.30.0"
KUSTOMIZATIONS = ["k8s/base", "k8s/overlays/gpu", "k8s/overlays/cpu-demo", "k8s/retrain"]
DEPLOYABLE = ["k8s/overlays/gpu", "k8s/overlays/cpu-demo", "k8s/retrain"]
DOMAINS = {"code", "general", "dialog"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: build(ROOT / name) for name in KUSTOMIZATIONS}


def _validate_core(resource: dict) -> None:
    kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def test_pinned_kubernetes_version_ships_offline():
    assert K8S_VERSION in kubernetes_validate.utils.all_versions()


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_core_objects_validate_strict(rendered, name):
    core = [r for r in rendered[name] if r["apiVersion"] == "v1"]
    assert core, f"{name} renders no core objects"
    for resource in core:
        _validate_core(resource)


def test_core_validation_rejects_unknown_field(rendered):
    pvc = by_kind(rendered["k8s/base"], "PersistentVolumeClaim")[0]
    pvc = {**pvc, "spec": {**pvc["spec"], "accesModes": ["ReadWriteOnce"]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_core(pvc)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kuberay_objects_validate_against_crd(rendered, name):
    ray = [r for r in rendered[name] if r["apiVersion"] == "ray.io/v1"]
    assert ray, f"{name} renders no KubeRay object"
    for resource in ray:
        crd_validator(resource["kind"]).validate(resource)
        # The pod templates also pass the (strict) core PodTemplate schema of K8S_VERSION.
        for template in pod_templates(resource):
            _validate_core({
                "apiVersion": "v1", "kind": "PodTemplate",
                "metadata": {"name": resource["metadata"]["name"]}, "template": template,
            })


@pytest.mark.parametrize("kind,spec_patch", [
    ("RayService", {"serveConfigV3": "x"}),
    ("RayService", {"rayClusterConfig": {"headGroupSpec": {"rayStartParams": {"num-cpus": 2}}}}),
    ("RayJob", {"shutdownAfterJobFinishes": "yes"}),
])
def test_crd_validation_rejects_bad_fields(rendered, kind, spec_patch):
    source = "k8s/base" if kind == "RayService" else "k8s/retrain"
    resource = by_kind(rendered[source], kind)[0]

    def merged(base, patch):
        if not isinstance(patch, dict):
            return patch
        return {**base, **{k: merged(base.get(k, {}), v) for k, v in patch.items()}}

    bad = {**resource, "spec": merged(resource["spec"], spec_patch)}
    with pytest.raises(jsonschema.ValidationError):
        crd_validator(kind).validate(bad)


def test_every_kustomization_references_existing_files():
    kustomizations = sorted((ROOT / "k8s").rglob("kustomization.yaml"))
    assert {str(k.parent.relative_to(ROOT)) for k in kustomizations} == set(KUSTOMIZATIONS)
    for kustomization in kustomizations:
        spec = load_docs(kustomization)[0]
        paths = spec.get("resources", []) + [p["path"] for p in spec.get("patches", []) if "path" in p]
        for entry in paths:
            target = kustomization.parent / entry
            assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{kustomization}: {entry}"


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_references_between_objects_resolve(rendered, name):
    resources = rendered[name] + (rendered["k8s/base"] if name == "k8s/retrain" else [])
    names = {(r["kind"], r["metadata"]["name"]) for r in resources}
    for ray in [r for r in resources if r["apiVersion"] == "ray.io/v1"]:
        for template in pod_templates(ray):
            spec = template["spec"]
            for volume in spec.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
                if "secret" in volume:
                    assert ("Secret", volume["secret"]["secretName"]) in names
            mounted = {v["name"] for v in spec.get("volumes", [])}
            for container in spec["containers"]:
                assert {m["name"] for m in container.get("volumeMounts", [])} <= mounted
                for source in container.get("envFrom", []):
                    assert ("ConfigMap", source["configMapRef"]["name"]) in names
                for env in container.get("env", []):
                    ref = env.get("valueFrom", {}).get("configMapKeyRef")
                    if ref:
                        configmap = [r for r in resources if r["kind"] == "ConfigMap"
                                     and r["metadata"]["name"] == ref["name"]]
                        assert configmap and ref["key"] in configmap[0]["data"], ref


def _containers(resource: dict) -> list[dict]:
    return [c for t in pod_templates(resource) for c in t["spec"]["containers"]]


def test_gpu_overlay_requests_gpus_and_uses_the_cuda_image(rendered):
    service = by_kind(rendered["k8s/overlays/gpu"], "RayService")[0]
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert workers and all(
        str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1" for w in workers for c in w["template"]["spec"]["containers"]
    )
    assert {c["image"] for c in _containers(service)} == {"registry.example.com/flashspec-router:0.1.0-cuda"}
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    generator = [d for d in config["applications"][0]["deployments"] if d["name"] == "Generator"][0]
    assert generator["ray_actor_options"]["num_gpus"] == 1
    assert config["applications"][0]["args"]["device"] == "cuda"


def test_cpu_demo_needs_no_gpu_and_no_prometheus_operator(rendered):
    resources = rendered["k8s/overlays/cpu-demo"]
    assert not [r for r in resources if r["apiVersion"].startswith("monitoring.coreos.com")]
    service = by_kind(resources, "RayService")[0]
    assert "nvidia.com/gpu" not in str(service["spec"]["rayClusterConfig"])
    # The head must have room for every deployment of the (CPU) serve config.
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    wanted = sum(d["num_replicas"] * d["ray_actor_options"]["num_cpus"] for d in config["applications"][0]["deployments"])
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert wanted <= float(head["rayStartParams"]["num-cpus"])
    assert by_kind(resources, "PersistentVolumeClaim")[0]["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_probes(rendered):
    cluster = by_kind(rendered["k8s/base"], "RayService")[0]["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    # The head is probed on Ray only: an app-level failure must not take the head out of its service.
    for probe in (head["readinessProbe"], head["livenessProbe"]):
        assert probe["httpGet"]["path"].startswith("/api/")
    for group in cluster["workerGroupSpecs"]:
        worker = group["template"]["spec"]["containers"][0]
        assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
        assert worker["livenessProbe"]["httpGet"]["path"] == "/api/local_raylet_healthz"
    agent_port = int(cluster["headGroupSpec"]["rayStartParams"]["dashboard-agent-listen-port"])
    assert head["livenessProbe"]["httpGet"]["port"] == agent_port


def test_podmonitors_scrape_ports_the_pods_have(rendered):
    resources = rendered["k8s/overlays/gpu"]
    service = by_kind(resources, "RayService")[0]
    monitors = by_kind(resources, "PodMonitor")
    assert monitors
    assert any(e["path"] == "/metrics" and e["port"] == "serve" for m in monitors for e in m["spec"]["podMetricsEndpoints"])
    cluster = service["spec"]["rayClusterConfig"]
    pods = [("head", cluster["headGroupSpec"]["template"])] + [("worker", g["template"]) for g in cluster["workerGroupSpecs"]]
    for monitor in monitors:
        selector = dict(monitor["spec"]["selector"]["matchLabels"])
        node_type = selector.pop("ray.io/node-type", None)  # set on Ray pods by KubeRay
        selected = [t for kind, t in pods if (node_type in (None, kind))
                    and selector.items() <= t["metadata"]["labels"].items()]
        assert selected, f"PodMonitor {monitor['metadata']['name']} selects no pod"
        for template in selected:
            ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert endpoint["port"] in ports


def test_tenant_secret_holds_only_key_hashes(rendered):
    secret = by_kind(rendered["k8s/base"], "Secret")[0]
    tenants = yaml.safe_load(secret["stringData"]["tenants.yaml"])
    assert tenants == yaml.safe_load((ROOT / "deploy" / "tenants.example.yaml").read_text())
    assert tenants["tenants"]
    for tenant in tenants["tenants"]:
        assert re.fullmatch(r"[0-9a-f]{64}", tenant["key_sha256"]), tenant["name"]
        assert not {k for k in tenant if "key" in k} - {"key_sha256"}, f"{tenant['name']}: a plaintext key field"
    settings = by_kind(rendered["k8s/base"], "ConfigMap")[0]["data"]
    service = by_kind(rendered["k8s/base"], "RayService")[0]
    mounts = [m for c in _containers(service) for m in c["volumeMounts"] if m["name"] == "tenants"]
    assert mounts and all(settings["FLASHSPEC_TENANTS_FILE"] == f"{m['mountPath']}/tenants.yaml" for m in mounts)


def test_retrain_job_trains_one_domain_into_the_shared_store(rendered):
    resources = rendered["k8s/retrain"]
    job = by_kind(resources, "RayJob")[0]["spec"]
    assert job["entrypoint"] == (
        "flashspec train-draft --domain $(DOMAIN) --target default --store /data/store --device cuda"
    )
    # $(DOMAIN) is expanded by Kubernetes in the submitter container, so it must define DOMAIN there.
    assert job["submissionMode"] == "K8sJobMode"
    submitter_env = {e["name"] for e in job["submitterPodTemplate"]["spec"]["containers"][0]["env"]}
    assert "DOMAIN" in submitter_env
    assert by_kind(resources, "ConfigMap")[0]["data"]["domain"] in DOMAINS
    head = job["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    claim = [v for v in head["volumes"] if "persistentVolumeClaim" in v][0]
    mount = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == claim["name"]][0]
    assert "/data/store".startswith(mount["mountPath"])
    serving = by_kind(rendered["k8s/overlays/gpu"], "RayService")[0]
    serving_claims = {v["persistentVolumeClaim"]["claimName"] for t in pod_templates(serving)
                      for v in t["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert serving_claims == {claim["persistentVolumeClaim"]["claimName"]}
    assert by_kind(rendered["k8s/overlays/gpu"], "PersistentVolumeClaim")[0]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert str(head["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert by_kind(resources, "RayJob")[0]["metadata"]["namespace"] == by_kind(
        rendered["k8s/overlays/gpu"], "RayService")[0]["metadata"]["namespace"]


def test_ray_version_matches_the_images(rendered):
    versions = set()
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        versions |= set(re.findall(r"^ARG RAY_VERSION=(\S+)$", (ROOT / dockerfile).read_text(), re.MULTILINE))
    assert len(versions) == 1
    for name in KUSTOMIZATIONS:
        for resource in [r for r in rendered[name] if r["apiVersion"] == "ray.io/v1"]:
            cluster = resource["spec"].get("rayClusterConfig") or resource["spec"]["rayClusterSpec"]
            assert {cluster["rayVersion"]} == versions
