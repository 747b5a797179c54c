"""A SUBSET of kustomize, enough to render deploy/kubernetes/ where no `kubectl kustomize` exists.

tests/deploy/test_manifests.py renders with the real kustomize (`kubectl kustomize`) when the
machine has it, and checks that this subset renders the same objects; without kubectl it renders
with this subset alone. It implements exactly what deploy/kubernetes/ uses, and raises
``Unsupported`` naming the field for anything else in a kustomization.yaml:

- ``resources``: YAML files (several documents each) and directories holding a kustomization;
- ``namespace``: set on every object but cluster-scoped kinds (``CLUSTER_SCOPED``), and on the
  ServiceAccount subjects of role bindings that name none;
- ``labels``: ``pairs`` added to every object's ``metadata.labels`` and, with
  ``includeTemplates``, to pod templates' labels; ``includeSelectors: true`` is not supported;
- ``images``: ``name`` → ``newName`` / ``newTag`` / ``digest`` in containers and init containers;
- ``patches`` with ``path``: a strategic-merge patch whose kind and name pick its one target; maps
  merge, the lists Kubernetes merges by key (``MERGE_KEYS``: containers, env, volumes, ...) merge
  item by item, every other list is replaced. Directives (``$patch``) are not supported.

Within one kustomization they run in this order: resources, patches, namespace, labels, images
(deploy/kubernetes/ never uses two of them in one kustomization where the order would matter).
Objects come out in the order their resources list them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "PersistentVolume",
        "StorageClass",
        "PriorityClass",
        "RuntimeClass",
        "IngressClass",
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    }
)
# The lists a strategic merge patch merges by a key (the Kubernetes API's patchMergeKey), by field name.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
KNOWN_FIELDS = frozenset({"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"})
POD_TEMPLATE_KINDS = frozenset({"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"})


class Unsupported(ValueError):
    """A kustomization uses a feature this subset does not render."""


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``directory``'s kustomization.yaml renders to."""
    path = directory / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(spec) - KNOWN_FIELDS)
    if unknown:
        raise Unsupported(f"{path}: {', '.join(unknown)} not in this kustomize subset")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources") or []:
        target = directory / entry
        if target.is_dir():
            objects += render(target)
        else:
            objects += [doc for doc in yaml.safe_load_all(target.read_text()) if doc]
    for patch in spec.get("patches") or []:
        if set(patch) != {"path"}:
            raise Unsupported(f"{path}: patches entry {patch}: only `path` (a strategic merge patch) is supported")
        _apply_patch(objects, yaml.safe_load((directory / patch["path"]).read_text()), directory / patch["path"])
    if spec.get("namespace"):
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
            if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
                for subject in obj.get("subjects") or []:
                    if subject.get("kind") == "ServiceAccount" and not subject.get("namespace"):
                        subject["namespace"] = spec["namespace"]
    for label in spec.get("labels") or []:
        _add_labels(objects, label, path)
    for image in spec.get("images") or []:
        for obj in objects:
            for container in _containers(obj):
                _set_image(container, image)
    return objects


def _apply_patch(objects: list[dict[str, Any]], patch: dict[str, Any], path: Path) -> None:
    if _has_directive(patch):
        raise Unsupported(f"{path}: $patch directives are not in this kustomize subset")
    name = patch["metadata"]["name"]
    targets = [o for o in objects if o["kind"] == patch["kind"] and o["metadata"]["name"] == name]
    if len(targets) != 1:
        raise Unsupported(f"{path}: {len(targets)} objects are {patch['kind']} {name}; a patch needs exactly one")
    merged = merge(targets[0], patch)
    targets[0].clear()
    targets[0].update(merged)


def _has_directive(value: Any) -> bool:
    if isinstance(value, dict):
        return any(str(k).startswith("$") for k in value) or any(_has_directive(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_directive(v) for v in value)
    return False


def merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """``patch`` merged into ``base`` as a strategic merge patch of this subset (module docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = merge(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and MERGE_KEYS.get(field or ""):
        key = MERGE_KEYS[field]
        out = copy.deepcopy(base)
        for item in patch:
            match = next((i for i, old in enumerate(out) if old.get(key) == item.get(key)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = merge(out[match], item)
        return out
    return copy.deepcopy(patch)


def _add_labels(objects: list[dict[str, Any]], label: dict[str, Any], path: Path) -> None:
    if label.get("includeSelectors"):
        raise Unsupported(f"{path}: labels with includeSelectors are not in this kustomize subset")
    pairs = label.get("pairs") or {}
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(pairs)
        if label.get("includeTemplates") and obj["kind"] in POD_TEMPLATE_KINDS:
            obj["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] not in POD_TEMPLATE_KINDS:
        return []
    pod = obj["spec"]["template"]["spec"]
    return list(pod.get("containers") or []) + list(pod.get("initContainers") or [])


def _set_image(container: dict[str, Any], image: dict[str, Any]) -> None:
    ref = container["image"]
    name, digest = (ref.split("@", 1) + [""])[:2]
    tag = ""
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    if name != image["name"]:
        return
    name = image.get("newName", name)
    if image.get("digest"):
        container["image"] = f"{name}@{image['digest']}"
        return
    tag = image.get("newTag", tag)
    container["image"] = f"{name}:{tag}" if tag else (f"{name}@{digest}" if digest else name)
