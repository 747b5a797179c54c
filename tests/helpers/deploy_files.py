"""What the deploy/ tests share: the kustomize targets, rendering them, and walking their pods.

``render(target)`` uses the real kustomize (``kubectl kustomize``, bundled with kubectl) when the
machine has it, else tests/helpers/kustomize_subset.py; ``renderer()`` says which. Nothing here
reaches the network.
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any, Iterator

import yaml

from tests.helpers import kustomize_subset

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
# Every kustomize target a user applies or builds on.
TARGETS = ("base", "overlays/cpu", "overlays/gpu")
# The Kubernetes release whose schemas the manifests must satisfy (kubernetes-validate bundles it).
KUBERNETES_VERSION = "1.31.0"
WORKLOAD_KINDS = frozenset({"Deployment", "DaemonSet", "StatefulSet", "Job"})


def kubectl() -> str | None:
    return shutil.which("kubectl")


def renderer() -> str:
    return "kubectl kustomize" if kubectl() else "tests/helpers/kustomize_subset.py"


@cache
def _render_text(target: str) -> str:
    done = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / target)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {target} failed: {done.stderr.strip()}")
    return done.stdout


def render_with_kubectl(target: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(_render_text(target)) if doc]


def render(target: str) -> list[dict[str, Any]]:
    """The objects ``deploy/kubernetes/<target>`` renders to."""
    if kubectl():
        return render_with_kubectl(target)
    return kustomize_subset.render(KUBERNETES / target)


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] not in WORKLOAD_KINDS:
        return None
    return obj["spec"]["template"]["spec"]


def containers(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    pod = pod_spec(obj)
    if pod is not None:
        yield from pod.get("initContainers") or []
        yield from pod.get("containers") or []


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def env_value(container: dict[str, Any], name: str) -> Any:
    """The ``value`` (or ``valueFrom``) of ``name`` in the container's env; KeyError if unset."""
    for entry in container.get("env") or []:
        if entry["name"] == name:
            return entry.get("value", entry.get("valueFrom"))
    raise KeyError(f"container {container['name']} does not set {name}")
