"""deploy/kubernetes/: every kustomize target renders, and every object it renders is valid against
the pinned Kubernetes release's schemas (``kubernetes-validate``, strict: unknown fields fail),
offline. Then what the schemas cannot see: the pods run as the agreed non-root, read-only, no
capability pods with resources; the API and the gateway are probed on ``/healthz``; every name a
pod refers to (ConfigMap, Secret, ServiceAccount) exists; every Service and PodDisruptionBudget
selects a workload; and the overlays place node agents as agreed (cpu: slots, no GPU; gpu: GPUs
requested, counted and tolerated; both: ``/dev/shm`` in memory, name and address from the
downward API).

Rendering: ``kubectl kustomize`` where kubectl exists (the real kustomize), else
tests/helpers/kustomize_subset.py; where both exist they must agree."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from tests.helpers import kustomize_subset
from tests.helpers.deploy_files import (
    KUBERNETES,
    KUBERNETES_VERSION,
    TARGETS,
    containers,
    env_value,
    find,
    kubectl,
    pod_spec,
    render,
    render_with_kubectl,
)

CONTROL_PLANE = ("rollouts-api", "rollouts-worker", "rollouts-gateway")
PROBED = {"rollouts-api": "api", "rollouts-gateway": "gateway"}


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_pinned_kubernetes_schemas_are_bundled():
    # Offline means the schemas ship in the package: the pinned release must be one it carries.
    assert kubernetes_validate.utils.all_versions()
    assert KUBERNETES_VERSION in kubernetes_validate.utils.all_versions()


@pytest.mark.parametrize("target", TARGETS)
def test_every_rendered_object_is_valid_kubernetes(target):
    objects = render(target)
    kinds = sorted({o["kind"] for o in objects})
    # The premise: the target renders the whole install, not an empty or partial list.
    for kind in ("Namespace", "ServiceAccount", "ConfigMap", "Secret", "Deployment", "Service", "DaemonSet",
                 "PodDisruptionBudget"):
        assert kind in kinds, f"{target}: renders no {kind} ({kinds})"
    for obj in objects:
        try:
            validate(obj)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{target}: {obj['kind']} {obj['metadata']['name']}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{target}: {exc.message}")


def test_the_validation_catches_a_broken_manifest():
    # Proves the check above can fail: a misspelt field and a wrong type are each rejected.
    deployment = find(render("base"), "Deployment", "rollouts-api")
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken)
    validate(deployment)


def _canonical(value: Any) -> Any:
    """Lists of named items in name order: kustomize puts a patch's new list items first."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_canonical(v) for v in value]
        if items and all(isinstance(i, dict) and "name" in i for i in items):
            items.sort(key=lambda i: i["name"])
        return items
    return value


@pytest.mark.skipif(kubectl() is None, reason="no kubectl here: only the kustomize subset renders")
@pytest.mark.parametrize("target", TARGETS)
def test_the_kustomize_subset_renders_what_kustomize_renders(target):
    def keyed(objects):
        return {(o["kind"], o["metadata"]["name"]): _canonical(o) for o in objects}

    real = keyed(render_with_kubectl(target))
    subset = keyed(kustomize_subset.render(KUBERNETES / target))
    assert sorted(subset) == sorted(real)
    for key, obj in real.items():
        assert subset[key] == obj, f"{target}: {key} differs between kustomize and the subset"


@pytest.mark.parametrize("target", TARGETS)
def test_pods_run_non_root_read_only_without_capabilities_and_with_resources(target):
    workloads = [o for o in render(target) if pod_spec(o) is not None]
    assert {o["metadata"]["name"] for o in workloads} >= {*CONTROL_PLANE, "rollouts-node"}
    for obj in workloads:
        pod, where = pod_spec(obj), f"{target}: {obj['kind']} {obj['metadata']['name']}"
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        # Only Dynamo's processes (its frontend, the node pods' workers) talk to the Kubernetes API.
        assert pod["automountServiceAccountToken"] is (pod["serviceAccountName"] == "rollouts-dynamo"), where
        mounts = set()
        for c in containers(obj):
            ctx = c["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in ctx["capabilities"], where
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], where
            assert c["resources"]["limits"]["memory"], where
            mounts |= {m["mountPath"] for m in c.get("volumeMounts") or []}
        # A read-only root: the paths a process writes are volumes.
        assert {"/tmp", "/home/rollouts", "/var/lib/rollouts"} <= mounts, where


@pytest.mark.parametrize("target", TARGETS)
def test_the_api_and_the_gateway_are_probed_on_healthz_and_the_worker_is_not(target):
    objects = render(target)
    for name, command in PROBED.items():
        (c,) = find(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        assert c["args"] == [command]
        port = c["ports"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}, f"{name} {probe}"
        assert env_value(c, "ROLLOUTS_HOST") == "0.0.0.0"
        port_env = "ROLLOUTS_API_PORT" if command == "api" else "ROLLOUTS_GATEWAY_PORT"
        assert int(env_value(c, port_env)) == port["containerPort"]
    # The worker serves only its metrics (worker.yaml says why it has no probe), on the port its
    # environment names; the node pod's replica agent likewise.
    (worker,) = find(objects, "Deployment", "rollouts-worker")["spec"]["template"]["spec"]["containers"]
    assert worker["args"] == ["worker"]
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    (metrics,) = worker["ports"]
    assert metrics["name"] == "metrics" and int(env_value(worker, "ROLLOUTS_WORKER_METRICS_PORT")) == metrics["containerPort"]
    (node,) = find(objects, "DaemonSet", "rollouts-node")["spec"]["template"]["spec"]["containers"]
    (metrics,) = node["ports"]
    assert int(env_value(node, "ROLLOUTS_REPLICA_METRICS_PORT")) == metrics["containerPort"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_reference_resolves_and_every_selector_selects(target):
    objects = render(target)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    namespace = find(objects, "Namespace", "rollouts")["metadata"]["name"]
    workloads = [o for o in objects if pod_spec(o) is not None]
    for obj in objects:
        if obj["kind"] not in kustomize_subset.CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == namespace, (obj["kind"], obj["metadata"]["name"])
    for obj in workloads:
        pod = pod_spec(obj)
        assert ("ServiceAccount", pod["serviceAccountName"]) in names
        assert obj["spec"]["selector"]["matchLabels"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()
        for c in containers(obj):
            for source in c.get("envFrom") or []:
                kind, ref = ("ConfigMap", source["configMapRef"]) if "configMapRef" in source else ("Secret", source["secretRef"])
                assert (kind, ref["name"]) in names, f"{obj['metadata']['name']}: {kind} {ref['name']} is not rendered"
        for volume in pod.get("volumes") or []:
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in names
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
    selectors = [(o["kind"], o["metadata"]["name"], o["spec"]["selector"]) for o in objects if o["kind"] == "Service"]
    selectors += [(o["kind"], o["metadata"]["name"], o["spec"]["selector"]["matchLabels"])
                  for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert len(selectors) == 7  # four Services (gateway, API, Dynamo's frontend and workers), three budgets
    for kind, name, labels in selectors:
        selected = [w for w in workloads if labels.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, f"{kind} {name} selects {len(selected)} workloads"


def _node_container(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    node = find(objects, "DaemonSet", "rollouts-node")
    (c,) = node["spec"]["template"]["spec"]["containers"]
    return node["spec"]["template"]["spec"], c


@pytest.mark.parametrize("target", TARGETS)
def test_node_agents_learn_their_name_and_address_and_get_memory_backed_shm(target):
    pod, c = _node_container(render(target))
    assert c["args"] == ["node"]
    assert env_value(c, "ROLLOUTS_NODE_NAME") == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env_value(c, "ROLLOUTS_NODE_ADDRESS") == {"fieldRef": {"fieldPath": "status.podIP"}}
    (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]


def test_the_cpu_overlay_runs_slots_and_requests_no_gpu():
    objects = render("overlays/cpu")
    pod, c = _node_container(objects)
    assert int(env_value(c, "ROLLOUTS_NODE_SLOTS")) > 0
    assert "nvidia.com/gpu" not in str(objects)
    assert all(x["image"].endswith("-cpu") for o in objects for x in containers(o))


def test_the_gpu_overlay_requests_the_gpus_it_offers_on_gpu_nodes():
    objects = render("overlays/gpu")
    pod, c = _node_container(objects)
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert env_value(c, "ROLLOUTS_NODE_GPUS") == gpus
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert c["image"].endswith("-gpu")
    # Only node agents run engines: the control plane asks for no GPU and keeps the CPU image.
    for name in CONTROL_PLANE:
        (cp,) = find(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        assert "nvidia.com/gpu" not in str(cp["resources"]) and cp["image"].endswith("-cpu")


def test_the_subset_refuses_what_it_does_not_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(kustomize_subset.Unsupported, match="commonLabels"):
        kustomize_subset.render(tmp_path)


@pytest.mark.parametrize("target", TARGETS)
def test_dynamos_kubernetes_discovery_is_wired(target):
    """What Dynamo 1.6.1's ``kubernetes`` discovery needs (dynamo.yaml): its CRD, a Role on it and on
    EndpointSlices for Dynamo's processes alone, the node pods behind a Service carrying Dynamo's
    discovery labels, and each Dynamo process told its pod by the downward API."""
    objects = render(target)
    crd = find(objects, "CustomResourceDefinition", "dynamoworkermetadatas.nvidia.com")
    assert (crd["spec"]["group"], crd["spec"]["scope"], crd["spec"]["names"]["kind"]) == (
        "nvidia.com", "Namespaced", "DynamoWorkerMetadata")
    assert [v["name"] for v in crd["spec"]["versions"] if v["served"] and v["storage"]] == ["v1alpha1"]
    role = find(objects, "Role", "rollouts-dynamo-discovery")
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert grants[("discovery.k8s.io", "endpointslices")] >= {"get", "list", "watch"}
    assert grants[("nvidia.com", "dynamoworkermetadatas")] >= {"create", "get", "list", "watch", "patch"}
    bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert [(b["roleRef"]["name"], [s["name"] for s in b["subjects"]]) for b in bindings] == [
        ("rollouts-dynamo-discovery", ["rollouts-dynamo"])]  # no other identity gets API access
    workers = find(objects, "Service", "rollouts-dynamo-workers")
    assert {"nvidia.com/dynamo-discovery-backend": "kubernetes",
            "nvidia.com/dynamo-discovery-enabled": "true"}.items() <= workers["metadata"]["labels"].items()
    node = find(objects, "DaemonSet", "rollouts-node")
    assert workers["spec"]["selector"].items() <= node["spec"]["template"]["metadata"]["labels"].items()
    config = find(objects, "ConfigMap", "rollouts-config")["data"]
    assert config["ROLLOUTS_DYNAMO_DISCOVERY"] == "kubernetes"
    frontend = find(objects, "Deployment", "rollouts-dynamo-frontend")
    (fc,) = frontend["spec"]["template"]["spec"]["containers"]
    assert fc["args"] == ["dynamo-frontend"]
    service = find(objects, "Service", "rollouts-dynamo-frontend")
    assert config["ROLLOUTS_DYNAMO_FRONTEND_URL"] == (
        f"http://rollouts-dynamo-frontend.rollouts.svc.cluster.local:{service['spec']['ports'][0]['port']}")
    assert int(env_value(fc, "ROLLOUTS_DYNAMO_PORT")) == fc["ports"][0]["containerPort"]
    for workload in (node, frontend):
        pod = workload["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "rollouts-dynamo" and pod["automountServiceAccountToken"] is True
        (c,) = pod["containers"]
        fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
        assert {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace",
                "POD_UID": "metadata.uid"}.items() <= fields.items(), workload["metadata"]["name"]
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in fc["env"] if "valueFrom" in e}[
        "ROLLOUTS_DYNAMO_ADDRESS"] == "status.podIP"
