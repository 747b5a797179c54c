"""deploy/kubernetes/: every kustomize target renders, and every object it renders is valid against
the pinned Kubernetes release's schemas (``kubernetes-validate``, strict: unknown fields fail),
offline. Then what the schemas cannot see: the pods run as the agreed non-root, read-only, no
capability pods with resources; the API and the gateway are probed on ``/healthz``; every name a
pod refers to (ConfigMap, Secret, ServiceAccount) exists; every Service and PodDisruptionBudget
selects a workload; and the overlays place node agents as agreed (cpu: slots, no GPU; gpu: GPUs
requested, counted and tolerated; both: ``/dev/shm`` in memory, name and address from the
downward API). The NetworkPolicies (base/networkpolicy.yaml, temporal/networkpolicy.yaml): each
selects pods that exist (rendered, or the Temporal chart's pods as its labels describe them), each
port an allow names is a containerPort of the pods it selects, a default deny isolates every pod,
each pod admits exactly the peers agreed (Dynamo's frontend's HTTP port: the gateways alone), and
only the processes that make S3 clients get the S3 keys.

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
    load_yaml_documents,
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
    for kind in (
        "Namespace",
        "ServiceAccount",
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "DaemonSet",
        "PodDisruptionBudget",
    ):
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
    assert (
        metrics["name"] == "metrics"
        and int(env_value(worker, "ROLLOUTS_WORKER_METRICS_PORT")) == metrics["containerPort"]
    )
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
                kind, ref = (
                    ("ConfigMap", source["configMapRef"])
                    if "configMapRef" in source
                    else ("Secret", source["secretRef"])
                )
                assert (kind, ref["name"]) in names, f"{obj['metadata']['name']}: {kind} {ref['name']} is not rendered"
        for volume in pod.get("volumes") or []:
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in names
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
    selectors = [(o["kind"], o["metadata"]["name"], o["spec"]["selector"]) for o in objects if o["kind"] == "Service"]
    selectors += [
        (o["kind"], o["metadata"]["name"], o["spec"]["selector"]["matchLabels"])
        for o in objects
        if o["kind"] == "PodDisruptionBudget"
    ]
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
        "nvidia.com",
        "Namespaced",
        "DynamoWorkerMetadata",
    )
    assert [v["name"] for v in crd["spec"]["versions"] if v["served"] and v["storage"]] == ["v1alpha1"]
    role = find(objects, "Role", "rollouts-dynamo-discovery")
    grants = {
        (g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert grants[("discovery.k8s.io", "endpointslices")] >= {"get", "list", "watch"}
    assert grants[("nvidia.com", "dynamoworkermetadatas")] >= {"create", "get", "list", "watch", "patch"}
    bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert [(b["roleRef"]["name"], [s["name"] for s in b["subjects"]]) for b in bindings] == [
        ("rollouts-dynamo-discovery", ["rollouts-dynamo"])
    ]  # no other identity gets API access
    workers = find(objects, "Service", "rollouts-dynamo-workers")
    assert {
        "nvidia.com/dynamo-discovery-backend": "kubernetes",
        "nvidia.com/dynamo-discovery-enabled": "true",
    }.items() <= workers["metadata"]["labels"].items()
    node = find(objects, "DaemonSet", "rollouts-node")
    assert workers["spec"]["selector"].items() <= node["spec"]["template"]["metadata"]["labels"].items()
    config = find(objects, "ConfigMap", "rollouts-config")["data"]
    assert config["ROLLOUTS_DYNAMO_DISCOVERY"] == "kubernetes"
    frontend = find(objects, "Deployment", "rollouts-dynamo-frontend")
    (fc,) = frontend["spec"]["template"]["spec"]["containers"]
    assert fc["args"] == ["dynamo-frontend"]
    service = find(objects, "Service", "rollouts-dynamo-frontend")
    assert config["ROLLOUTS_DYNAMO_FRONTEND_URL"] == (
        f"http://rollouts-dynamo-frontend.rollouts.svc.cluster.local:{service['spec']['ports'][0]['port']}"
    )
    assert int(env_value(fc, "ROLLOUTS_DYNAMO_PORT")) == fc["ports"][0]["containerPort"]
    for workload in (node, frontend):
        pod = workload["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "rollouts-dynamo" and pod["automountServiceAccountToken"] is True
        (c,) = pod["containers"]
        fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
        assert {
            "POD_NAME": "metadata.name",
            "POD_NAMESPACE": "metadata.namespace",
            "POD_UID": "metadata.uid",
        }.items() <= fields.items(), workload["metadata"]["name"]
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in fc["env"] if "valueFrom" in e}[
        "ROLLOUTS_DYNAMO_ADDRESS"
    ] == "status.podIP"


# --- NetworkPolicies (base/networkpolicy.yaml, temporal/networkpolicy.yaml) -----------------------
# A pod as the policies see it: where it runs, its labels and its container ports (name -> number).
# The rendered workloads, the search-attributes Job, and the pods of the Temporal Helm chart, which
# nothing here renders: the labels and ports the chart (temporalio/helm-charts 1.6.0,
# templates/_helpers.tpl temporal.resourceLabels, server-deployment.yaml, web-deployment.yaml) gives
# release `temporal` in namespace `temporal`, as values.yaml configures it.
TEMPORAL_CHART_PODS = {
    component: ports
    for component, ports in {
        "frontend": {"rpc": 7233, "membership": 6933, "http": 7243, "metrics": 9090},
        "history": {"rpc": 7234, "membership": 6934, "metrics": 9090},
        "matching": {"rpc": 7235, "membership": 6935, "metrics": 9090},
        "worker": {"membership": 6939, "metrics": 9090},
        "web": {"http": 8080},
    }.items()
}
TEMPORAL_NETWORK_POLICIES = KUBERNETES / "temporal" / "networkpolicy.yaml"
ANYWHERE = "anywhere"
ALL_PORTS = (1, 65535)


def _with_temporal(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A target's objects and what deploy/kubernetes/temporal/ applies next to the chart."""
    return [
        *objects,
        *load_yaml_documents(TEMPORAL_NETWORK_POLICIES),
        *load_yaml_documents(KUBERNETES / "temporal" / "search-attributes-job.yaml"),
    ]


def _pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = []
    for obj in objects:
        if pod_spec(obj) is None:
            continue
        ports = {
            p.get("name", str(p["containerPort"])): p["containerPort"]
            for c in containers(obj)
            for p in c.get("ports") or []
        }
        pods.append(
            {
                "name": obj["metadata"]["name"],
                "namespace": obj["metadata"]["namespace"],
                "labels": obj["spec"]["template"]["metadata"]["labels"],
                "ports": ports,
            }
        )
    for component, ports in TEMPORAL_CHART_PODS.items():
        labels = {
            "app.kubernetes.io/name": "temporal",
            "app.kubernetes.io/instance": "temporal",
            "app.kubernetes.io/component": component,
        }
        pods.append({"name": f"temporal-{component}", "namespace": "temporal", "labels": labels, "ports": ports})
    return pods


def _policies(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions") or []:
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", ()),
            "NotIn": value not in e.get("values", ()),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _selected(policy: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    namespace = policy["metadata"]["namespace"]
    return [p for p in pods if p["namespace"] == namespace and _matches(policy["spec"]["podSelector"], p["labels"])]


def _peers(policy: dict[str, Any], rule: dict[str, Any], pods: list[dict[str, Any]]) -> set[str]:
    """Who a rule admits: pod names, ``namespace NAME`` for a whole namespace we do not render, or
    :data:`ANYWHERE`. A peer selector that selects no pod fails."""
    if "from" not in rule or not rule["from"]:
        return {ANYWHERE}
    where = policy["metadata"]["name"]
    peers: set[str] = set()
    for peer in rule["from"]:
        if "ipBlock" in peer:
            peers.add(ANYWHERE if peer["ipBlock"]["cidr"] in ("0.0.0.0/0", "::/0") else peer["ipBlock"]["cidr"])
            continue
        known = {p["namespace"] for p in pods}
        if "namespaceSelector" in peer:
            # One namespace, by the name label Kubernetes sets: a wider selector would admit pods
            # that anyone able to create pods anywhere can label as ours.
            selector = peer["namespaceSelector"]
            assert set(selector) == {"matchLabels"} and list(selector["matchLabels"]) == [
                "kubernetes.io/metadata.name"
            ], f"{where}: from {peer}: name one namespace"
            names = [n for n in known if _matches(selector, {"kubernetes.io/metadata.name": n})]
            if not names:
                assert "podSelector" not in peer, f"{where}: from {peer} selects no pod"
                peers.add(f"namespace {selector['matchLabels']['kubernetes.io/metadata.name']}")
                continue
        else:
            names = [policy["metadata"]["namespace"]]
        if "podSelector" not in peer:
            peers |= {f"namespace {n}" for n in names}
            continue
        chosen = [p["name"] for p in pods if p["namespace"] in names and _matches(peer["podSelector"], p["labels"])]
        assert chosen, f"{where}: from {peer} selects no pod"
        peers |= set(chosen)
    return peers


def _port_ranges(rule: dict[str, Any], pod: dict[str, Any], where: str) -> list[tuple[int, int]]:
    """The ports of ``pod`` a rule admits, as ranges. A port it names must be one of the pod's
    containerPorts; a range (``endPort``) must miss every one of them (those are named)."""
    if not rule.get("ports"):
        return [ALL_PORTS]
    ranges = []
    for entry in rule["ports"]:
        assert entry.get("protocol", "TCP") == "TCP", where
        port = entry.get("port")
        if port is None:
            ranges.append(ALL_PORTS)
        elif "endPort" in entry:
            assert not [n for n in pod["ports"].values() if port <= n <= entry["endPort"]], (
                f"{where}: range {port}-{entry['endPort']} covers a containerPort of {pod['name']} {pod['ports']}"
            )
            ranges.append((port, entry["endPort"]))
        else:
            number = pod["ports"].get(port) if isinstance(port, str) else port
            assert number in pod["ports"].values(), f"{where}: port {port} is no containerPort of {pod['name']}"
            ranges.append((number, number))
    return ranges


def _admitted(objects: list[dict[str, Any]]) -> dict[str, list[tuple[set[str], list[tuple[int, int]]]]]:
    """Each pod: the (peers, port ranges) its policies admit. Checks, on the way, that every
    policy selects a pod, and every peer selector and port (see above) is real."""
    pods, admitted = _pods(objects), {}
    for policy in _policies(objects):
        where = f"NetworkPolicy {policy['metadata']['name']}"
        assert policy["spec"].get("policyTypes") == ["Ingress"], where
        selected = _selected(policy, pods)
        assert selected, f"{where}: its podSelector selects no pod"
        for pod in selected:
            admitted.setdefault(pod["name"], [])
            for rule in policy["spec"].get("ingress") or []:
                peers = _peers(policy, rule, pods)
                ranges = _port_ranges(rule, pod, f"{where} on {pod['name']}")
                # Any port, or a range, only for pods named one by one, never for anyone.
                if ALL_PORTS in ranges or any(a != b for a, b in ranges):
                    assert all(p.startswith(("rollouts-", "temporal-")) for p in peers), (
                        f"{where}: every port, or a range, open to {sorted(peers)}: only named pods may be"
                    )
                admitted[pod["name"]].append((peers, ranges))
    return admitted


def _check_default_deny(objects: list[dict[str, Any]]) -> None:
    """Every pod is selected by some policy (so it is isolated), and the rollouts namespace has a
    policy that selects all of its pods and admits nothing."""
    pods, policies = _pods(objects), _policies(objects)
    denies = [
        p
        for p in policies
        if p["metadata"]["namespace"] == "rollouts" and p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
    ]
    assert denies, "no default deny in namespace rollouts"
    for pod in pods:
        if pod["name"] == "rollouts-search-attributes":
            continue  # a Job of ours in Temporal's namespace: calls out only
        assert any(pod in _selected(p, pods) for p in policies), f"no policy isolates {pod['name']}"


def _check_dynamo_frontend(objects: list[dict[str, Any]]) -> None:
    """Dynamo's frontend answers without a token: its HTTP port admits the gateway pods alone."""
    (c,) = find(objects, "Deployment", "rollouts-dynamo-frontend")["spec"]["template"]["spec"]["containers"]
    http = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    rules = _admitted(objects)["rollouts-dynamo-frontend"]
    on_http = [peers for peers, ranges in rules if any(a <= http <= b for a, b in ranges)]
    assert on_http, "no gateway reaches Dynamo's frontend"
    for peers in on_http:
        assert peers == {"rollouts-gateway"}, f"Dynamo's frontend's port {http} admits {peers}"


# Who reaches each pod, on any of its ports.
EXPECTED_PEERS = {
    "rollouts-api": {ANYWHERE},
    "rollouts-gateway": {ANYWHERE},
    "rollouts-dynamo-frontend": {"rollouts-gateway", "rollouts-node"},
    "rollouts-node": {"rollouts-dynamo-frontend", "rollouts-gateway", "rollouts-node", "namespace monitoring"},
    "rollouts-worker": {"namespace monitoring"},
    "temporal-frontend": {
        "rollouts-api",
        "rollouts-worker",
        "rollouts-gateway",
        "rollouts-node",
        "rollouts-search-attributes",
        *(f"temporal-{c}" for c in TEMPORAL_CHART_PODS),
    },
    **{f"temporal-{c}": {f"temporal-{x}" for x in TEMPORAL_CHART_PODS} for c in TEMPORAL_CHART_PODS if c != "frontend"},
}


def _check_peers(objects: list[dict[str, Any]]) -> None:
    admitted = _admitted(objects)
    for name, expected in EXPECTED_PEERS.items():
        peers = set().union(*(p for p, _ in admitted.get(name, [])))
        assert peers == expected, f"{name} admits {sorted(peers)}, expected {sorted(expected)}"
        # From anywhere: the HTTP port alone.
        for rule_peers, ranges in admitted.get(name, []):
            if ANYWHERE in rule_peers:
                assert name in ("rollouts-api", "rollouts-gateway"), name
                (http,) = [
                    n
                    for port, n in next(p for p in _pods(objects) if p["name"] == name)["ports"].items()
                    if port == "http"
                ]
                assert ranges == [(http, http)], f"{name}: {ranges} open to anyone"


@pytest.mark.parametrize("target", TARGETS)
def test_network_policies_select_real_pods_and_ports_and_deny_by_default(target):
    objects = _with_temporal(render(target))
    assert len([p for p in _policies(objects) if p["metadata"]["namespace"] == "rollouts"]) >= 5
    assert len([p for p in _policies(objects) if p["metadata"]["namespace"] == "temporal"]) >= 2
    _check_default_deny(objects)
    _check_peers(objects)
    _check_dynamo_frontend(objects)
    for policy in _policies(objects):
        validate(policy)


def _policy(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return find(objects, "NetworkPolicy", name)["spec"]


def _api_reaches_the_frontend(objects):
    _policy(objects, "rollouts-dynamo-frontend")["ingress"][0]["from"].append(
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rollouts-api"}}}
    )


def _frontend_open_to_anyone(objects):
    del _policy(objects, "rollouts-dynamo-frontend")["ingress"][0]["from"]


def _frontend_from_any_namespace(objects):
    _policy(objects, "rollouts-dynamo-frontend")["ingress"][0]["from"][0]["namespaceSelector"] = {}


def _range_covers_the_frontends_http(objects):
    _policy(objects, "rollouts-dynamo-frontend")["ingress"][1]["ports"][1]["port"] = 7000


def _misspelt_pod(objects):
    _policy(objects, "rollouts-gateway")["podSelector"]["matchLabels"]["app.kubernetes.io/name"] = "rollouts-gatway"


def _misspelt_peer(objects):
    _policy(objects, "rollouts-node")["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/name"
    ] = "rollouts-dynamo-frontnd"


def _misspelt_temporal_label(objects):
    _policy(objects, "temporal-frontend")["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] = "temporal-1"


def _wrong_port(objects):
    _policy(objects, "rollouts-api")["ingress"][0]["ports"][0]["port"] = 8081


def _node_open_to_anyone(objects):
    _policy(objects, "rollouts-node")["ingress"].append({})


def _api_opens_a_second_port(objects):
    (c,) = find(objects, "Deployment", "rollouts-api")["spec"]["template"]["spec"]["containers"]
    c["ports"].append({"name": "debug", "containerPort": 5678})
    _policy(objects, "rollouts-api")["ingress"][0]["ports"].append({"protocol": "TCP", "port": "debug"})


def _worker_takes_the_gateway(objects):
    _policy(objects, "rollouts-metrics")["ingress"][0]["from"].append(
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rollouts-gateway"}}}
    )


def _temporal_takes_the_dynamo_frontend(objects):
    _policy(objects, "temporal-frontend")["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0][
        "values"
    ].append("rollouts-dynamo-frontend")


def _deny_narrowed(objects):
    _policy(objects, "rollouts-default-deny-ingress")["podSelector"] = {
        "matchLabels": {"app.kubernetes.io/name": "rollouts-api"}
    }


def _temporal_web_unselected(objects):
    for name in ("temporal-default-deny-ingress", "temporal-internal"):
        _policy(objects, name)["podSelector"]["matchExpressions"] = [
            {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["web"]}
        ]


# (how a copy of the base and Temporal's policies is broken, the check that must refuse it, what
# the refusal says)
BROKEN_POLICIES = [
    (_api_reaches_the_frontend, _check_dynamo_frontend, "admits"),
    (_frontend_open_to_anyone, _check_dynamo_frontend, "admits"),
    (_frontend_from_any_namespace, _check_dynamo_frontend, "name one namespace"),
    (_range_covers_the_frontends_http, _admitted, "covers a containerPort"),
    (_misspelt_pod, _admitted, "selects no pod"),
    (_misspelt_peer, _admitted, "selects no pod"),
    (_misspelt_temporal_label, _admitted, "selects no pod"),
    (_wrong_port, _admitted, "is no containerPort"),
    (_node_open_to_anyone, _admitted, "open to \\['anywhere"),
    (_api_opens_a_second_port, _check_peers, "open to anyone"),
    (_worker_takes_the_gateway, _check_peers, "rollouts-worker admits"),
    (_temporal_takes_the_dynamo_frontend, _check_peers, "temporal-frontend admits"),
    (_deny_narrowed, _check_default_deny, "no default deny"),
    (_temporal_web_unselected, _check_default_deny, "no policy isolates temporal-web"),
]


@pytest.mark.parametrize(
    ("change", "check", "says"), BROKEN_POLICIES, ids=[c.__name__.strip("_") for c, _, _ in BROKEN_POLICIES]
)
def test_the_network_policy_checks_catch_a_broken_policy(change, check, says):
    # Proves the checks above can fail: each broken copy is refused, for its reason, by the check
    # that passes on the files as shipped.
    objects = _with_temporal(render("base"))
    check(objects)
    broken = copy.deepcopy(objects)
    change(broken)
    with pytest.raises(AssertionError, match=says):
        check(broken)


@pytest.mark.parametrize("target", TARGETS)
def test_only_the_processes_that_use_s3_get_its_keys(target):
    # S3 clients: the control worker (control/activities.py) and the replicas under the node agents
    # (replica/agent/process.py); the API, the gateway and Dynamo's frontend make none.
    objects = render(target)
    holders = {
        o["metadata"]["name"]
        for o in objects
        for c in containers(o)
        for source in c.get("envFrom") or []
        if source.get("secretRef", {}).get("name") == "rollouts-s3"
    }
    assert holders == {"rollouts-worker", "rollouts-node"}
    for name in ("rollouts-api", "rollouts-gateway"):
        (c,) = find(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        assert env_value(c, "AWS_SECRET_ACCESS_KEY") == "unused-no-s3-here", name
