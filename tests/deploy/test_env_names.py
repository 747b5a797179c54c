"""Every environment variable deploy/ sets is one the code reads.

The names come from every Kubernetes target's containers (``env`` entries, and the keys of the
ConfigMaps and Secrets they take whole through ``envFrom``), the Temporal search-attribute Job, the
Slurm script's assignments, the systemd units' ``Environment=`` lines and the env-file examples
(commented-out assignments included: they document settings to set). A name counts as read when a
string constant equal to it (not a docstring) appears in the Python sources of the processes
(``SOURCE_PACKAGES``), or when common/settings.py builds it from ``ENV_FIELDS``
(``ROLLOUTS_<FIELD>``). A name set anywhere and read nowhere fails the test, naming where it is set.
"""

from __future__ import annotations

import re
from collections import defaultdict

import common.settings
from tests.helpers.deploy_files import DEPLOY, REPO, TARGETS, containers, load_yaml_documents, render
from tests.helpers.source_strings import string_constants

SOURCE_PACKAGES = ("common", "api", "gateway", "control", "replica", "workers")
ASSIGNMENT = re.compile(r"^\s*(?:#\s*)?(?:export\s+)?([A-Z][A-Z0-9_]*)=", re.MULTILINE)
SYSTEMD_ENVIRONMENT = re.compile(r"^Environment=([A-Z][A-Z0-9_]*)=", re.MULTILINE)


def names_the_code_reads() -> set[str]:
    names: set[str] = set()
    for package in SOURCE_PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            names |= string_constants(path.read_text(), filename=str(path))
    names |= {f"ROLLOUTS_{field.upper()}" for field in getattr(common.settings, "ENV_FIELDS", ())}
    return names


def names_deploy_sets() -> dict[str, set[str]]:
    """Each variable name deploy/ sets -> where (file, object or line kind)."""
    where: dict[str, set[str]] = defaultdict(set)
    for target in TARGETS:
        objects = render(target)
        whole = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("ConfigMap", "Secret")}
        for obj in objects:
            for c in containers(obj):
                for entry in c.get("env") or []:
                    where[entry["name"]].add(f"kubernetes/{target} {obj['metadata']['name']}")
                for source in c.get("envFrom") or []:
                    kind, ref = (
                        ("ConfigMap", source["configMapRef"])
                        if "configMapRef" in source
                        else ("Secret", source["secretRef"])
                    )
                    data = whole[(kind, ref["name"])]
                    for key in {**data.get("data", {}), **data.get("stringData", {})}:
                        where[key].add(f"kubernetes/{target} {kind} {ref['name']}")
    for job in load_yaml_documents(DEPLOY / "kubernetes" / "temporal" / "search-attributes-job.yaml"):
        for c in containers(job):
            for entry in c.get("env") or []:
                where[entry["name"]].add("kubernetes/temporal/search-attributes-job.yaml")
    for path in sorted((DEPLOY / "slurm").glob("*.sbatch")) + sorted((DEPLOY / "systemd").glob("*.example")):
        for name in ASSIGNMENT.findall(path.read_text()):
            where[name].add(str(path.relative_to(DEPLOY)))
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        for name in SYSTEMD_ENVIRONMENT.findall(path.read_text()):
            where[name].add(str(path.relative_to(DEPLOY)))
    return where


def test_the_collection_sees_every_kind_of_source():
    # The premise: names come from each kind of file (a parser that found nothing would pass below).
    sources = {s for places in names_deploy_sets().values() for s in places}
    for kind in (
        "kubernetes/overlays/gpu",
        "search-attributes-job",
        "slurm/",
        "systemd/rollouts-node.service",
        "systemd/rollouts.env.example",
        "ConfigMap rollouts-config",
        "Secret rollouts-s3",
    ):
        assert any(kind in s for s in sources), f"no variable found in {kind}"


def test_the_reader_finds_names_read_and_not_names_only_mentioned():
    read = names_the_code_reads()
    assert {"TEMPORAL_ADDRESS", "ROLLOUTS_ENGINE_KEY", "AWS_ENDPOINT_URL_S3"} <= read
    # A name only in docstrings or messages is not read.
    assert "ROLLOUTS_NO_SUCH_SETTING" not in read


def test_every_variable_deploy_sets_is_read_by_the_code():
    read = names_the_code_reads()
    unread = {name: places for name, places in names_deploy_sets().items() if name not in read}
    assert not unread, (
        "set by deploy/ but read by no code under "
        + ", ".join(SOURCE_PACKAGES)
        + ":\n"
        + "\n".join(f"  {name}: set in {', '.join(sorted(places))}" for name, places in sorted(unread.items()))
    )
