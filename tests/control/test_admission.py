"""Hot-load admission through the API and the deployment workflow, on the real Temporal dev server:
each documented rule is its own error with its code and message, and nothing starts when a
request is refused. Replicas are test activities (tests/helpers/harness.py); no vLLM."""

from __future__ import annotations

import asyncio

from temporalio.client import WorkflowExecutionStatus

from contracts import names
from contracts.records import (
    SnapshotRef,
    SnapshotType,
)
from snapshots.chain import MAX_CHAIN_DELTAS as MAX_DELTAS_IN_CHAIN
from tests.helpers.harness import DISABLED_ORG, ORG, VIEWER, ZONE, Fleet, write_delta, write_full
from tests.helpers.workflow_checks import delta_body, deployment_state, error, every


async def no_hot_load_started(f: Fleet, dep: str) -> None:
    r = await f.call("GET", "/hotLoads", params={"parentDeploymentId": dep})
    assert r.status_code == 200 and r.json()["hotLoads"] == [], r.json()


async def test_deployment_not_ready_is_failed_precondition(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path, report_ready=False) as f:
        dep = await f.ready_deployment(wait=False)
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        r = await f.create_hot_load(dep, "s1")
        error(r, 412, "failed_precondition", f"deployment {dep} is STATUS_CREATING, not STATUS_READY")
        await no_hot_load_started(f, dep)


async def test_organization_without_hot_load_is_refused(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment(hot_load=False, token=DISABLED_ORG)
        r = await f.create_hot_load(dep, "s1", token=DISABLED_ORG)
        body = error(r, 412, "failed_precondition")
        assert body["message"] == "hot-load is not enabled for this organization"


async def test_deployment_without_hot_load_section_is_refused(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment(hot_load=False)
        r = await f.create_hot_load(dep, "s1")
        error(r, 412, "failed_precondition", f"hot-load is not enabled on deployment {dep}", "hotLoad section")


async def test_second_hot_load_while_one_runs_is_already_in_progress(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        f.apply_behaviour = {"*": f.held}
        f.apply_behaviour = every(f.held)
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        write_full(f.bucket_root / f"ckpt/{dep}", "s2")
        first = await f.create_hot_load(dep, "s1", hotLoadId="first")
        assert first.status_code == 200, first.text
        r = await f.create_hot_load(dep, "s2", hotLoadId="second")
        error(r, 412, "failed_precondition", "already in progress", "first")
        # The refused id was never used: once the first ends, it is admitted.
        f.hold.set()
        await f.wait_hot_load("first")
        await f.wait_idle(dep)
        f.apply_behaviour = {}
        r = await f.create_hot_load(dep, "s2", hotLoadId="second")
        assert r.status_code == 200, r.text


async def test_twenty_concurrent_creates_admit_exactly_one(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        f.apply_behaviour = every(f.held)
        for i in range(20):
            write_full(f.bucket_root / f"ckpt/{dep}", f"s{i}")
        answers = await asyncio.gather(*(f.create_hot_load(dep, f"s{i}", hotLoadId=f"c{i}") for i in range(20)))
        admitted = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code != 200]
        assert len(admitted) == 1, [r.json() for r in answers]
        assert len(refused) == 19
        for r in refused:
            error(r, 412, "failed_precondition", "already in progress")
        listed = (await f.call("GET", "/hotLoads", params={"parentDeploymentId": dep})).json()["hotLoads"]
        assert [h["spec"]["id"] for h in listed] == [admitted[0].json()["hotLoad"]["spec"]["id"]]
        f.hold.set()


async def test_type_and_metadata_must_match(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        r = await f.create_hot_load(
            dep, "s1", **{"incrementalSnapshotMetadata": delta_body("s0")["incrementalSnapshotMetadata"]}
        )
        error(r, 400, "invalid_argument", "incrementalSnapshotMetadata must be omitted for SNAPSHOT_TYPE_FULL")
        r = await f.create_hot_load(dep, "s1", type="SNAPSHOT_TYPE_INCREMENTAL")
        error(r, 400, "invalid_argument", "incrementalSnapshotMetadata is required for SNAPSHOT_TYPE_INCREMENTAL")
        await no_hot_load_started(f, dep)


async def test_unsupported_formats_are_invalid_argument(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        for field, value, supported in [
            ("checksumFormat", "CHECKSUM_FORMAT_XXH3_128", "CHECKSUM_FORMAT_ADLER32"),
            ("compressionFormat", "COMPRESSION_FORMAT_LZ4", "COMPRESSION_FORMAT_ZSTD"),
        ]:
            body = delta_body("s0")
            body["incrementalSnapshotMetadata"][field] = value
            error(await f.create_hot_load(dep, "s1", **body), 400, "invalid_argument", field, supported)


async def test_identity_rules(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        for identity, words in [
            ("../etc", "single path segment"),
            ("a/b", "single path segment"),
            ("..", ".."),
            ("x" * 129, "at most 128"),
            ("initial", "reserved"),
            ("", "non-empty"),
            ("a\x00b", "control"),
        ]:
            error(await f.create_hot_load(dep, identity), 400, "invalid_argument", "identity", words)
        error(
            await f.create_hot_load(dep, "s1", **delta_body("initial")),
            400,
            "invalid_argument",
            "previousSnapshotIdentity",
            "reserved",
        )
        await no_hot_load_started(f, dep)


async def test_predecessor_needs_a_completed_hot_load_on_this_deployment(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        other = await f.ready_deployment()
        root = f.bucket_root / f"ckpt/{dep}"
        write_delta(root, "s1", "s0")
        # Never loaded anywhere.
        error(
            await f.create_hot_load(dep, "s1", **delta_body("s0")),
            412,
            "failed_precondition",
            "previousSnapshotIdentity 's0' has no completed hot-load",
            dep,
        )
        # Completed on another deployment only.
        await f.completed(other, "s0")
        error(
            await f.create_hot_load(dep, "s1", **delta_body("s0")),
            412,
            "failed_precondition",
            "has no completed hot-load",
        )
        # Loaded here but FAILED.
        f.apply_behaviour = every(f.broken)
        write_full(root, "s0")
        r = await f.create_hot_load(dep, "s0")
        assert r.status_code == 200
        assert (await f.wait_hot_load(r.json()["hotLoad"]["spec"]["id"]))["status"]["state"] == "HOT_LOAD_STATE_FAILED"
        await f.wait_idle(dep)
        error(
            await f.create_hot_load(dep, "s1", **delta_body("s0")),
            412,
            "failed_precondition",
            "has no completed hot-load",
        )
        # Completed here: admitted, and the chain lists the base first.
        f.apply_behaviour = {}
        await f.completed(dep, "s0")
        hl = await f.completed(dep, "s1", **delta_body("s0"))
        assert [(c["identity"], c["type"]) for c in hl["spec"]["snapshotChain"]] == [
            ("s0", "SNAPSHOT_TYPE_FULL"),
            ("s1", "SNAPSHOT_TYPE_INCREMENTAL"),
        ]
        assert hl["spec"]["snapshotChain"][1]["compressionFormat"] == "COMPRESSION_FORMAT_ZSTD"


async def test_chain_of_more_than_63_deltas_is_refused(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        base = SnapshotRef(identity="d0", type=SnapshotType.FULL, hot_load_id="h0")
        links = [base] + [
            SnapshotRef(identity=f"d{i}", type=SnapshotType.INCREMENTAL, hot_load_id=f"h{i}")
            for i in range(1, MAX_DELTAS_IN_CHAIN + 1)
        ]
        chains = {link.identity: links[: i + 1] for i, link in enumerate(links)}
        dep = await f.deployment_from_state(deployment_state("dep-chain", zones=[ZONE], chains=chains))
        root = f.bucket_root / "ckpt/dep-chain"
        write_full(root, "d0")
        for i in range(1, MAX_DELTAS_IN_CHAIN + 2):
            write_delta(root, f"d{i}", f"d{i - 1}")
        write_delta(root, "d63b", "d62")
        body = error(
            await f.create_hot_load(dep, "d64", **delta_body("d63")),
            412,
            "failed_precondition",
            f"the chain would hold {MAX_DELTAS_IN_CHAIN + 1} deltas",
            f"at most {MAX_DELTAS_IN_CHAIN}",
        )
        assert "publish a full checkpoint" in body["message"]
        # 63 deltas is the limit, not past it.
        r = await f.create_hot_load(dep, "d63b", **delta_body("d62"))
        assert r.status_code == 200, r.text
        chain = r.json()["hotLoad"]["spec"]["snapshotChain"]
        assert len(chain) == 64 and chain[0]["identity"] == "d0" and chain[-1]["identity"] == "d63b"


async def test_missing_required_files_are_named(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        root = f.bucket_root / f"ckpt/{dep}"
        write_full(root, "s1", missing=("config.json", "model-00001-of-00001.safetensors"))
        r = await f.create_hot_load(dep, "s1", hotLoadId="retry-me")
        error(
            r,
            412,
            "failed_precondition",
            "'s1'",
            "missing required files",
            "config.json",
            "model-00001-of-00001.safetensors",
            f"s3://rollouts/ckpt/{dep}/s1/",
        )
        await no_hot_load_started(f, dep)
        write_full(root, "s1")
        await f.completed(dep, "s1", hotLoadId="retry-me")  # the refused id is free again
        # A delta without its index. (An earlier link of the chain that lost a file is refused
        # when a replica will read it: tests/control/test_chain_checks.py.)
        write_delta(root, "s3", "s1", missing=("model.safetensors.index.json",))
        error(
            await f.create_hot_load(dep, "s3", **delta_body("s1")),
            412,
            "failed_precondition",
            "snapshot 's3'",
            "model.safetensors.index.json",
        )


async def test_gateways_in_different_zones_are_refused(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.deployment_from_state(deployment_state("dep-zones", zones=["US-EAST-04A", "US-WEST-01A"]))
        write_full(f.bucket_root / "ckpt/dep-zones", "s1")
        error(
            await f.create_hot_load(dep, "s1"),
            412,
            "failed_precondition",
            "different zones",
            "US-EAST-04A",
            "US-WEST-01A",
        )


async def test_existing_client_chosen_id_is_already_exists(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        other = await f.ready_deployment()
        await f.completed(dep, "s1", hotLoadId="mine")
        write_full(f.bucket_root / f"ckpt/{dep}", "s2")
        write_full(f.bucket_root / f"ckpt/{other}", "s2")
        error(await f.create_hot_load(dep, "s2", hotLoadId="mine"), 409, "already_exists", "mine")
        error(await f.create_hot_load(other, "s2", hotLoadId="mine"), 409, "already_exists", "mine")
        # cwtrain then GETs it: the original operation, unchanged.
        got = (await f.call("GET", "/hotLoads/mine")).json()["hotLoad"]
        assert got["spec"]["identity"] == "s1" and got["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"


async def test_viewer_and_other_org_cannot_create(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        error(await f.create_hot_load(dep, "s1", token=VIEWER), 403, "permission_denied", "creating a hot-load")
        error(await f.create_hot_load(dep, "s1", token="other-org-token"), 404, "not_found", dep)
        await no_hot_load_started(f, dep)
        handle = f.client.get_workflow_handle(names.deployment_workflow_id(ORG, dep))
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING


async def test_the_replica_check_and_the_snapshot_checks_run_at_once(temporal_env, tmp_path):
    """Admission is one round trip through Temporal: the replica check and every snapshot check
    are scheduled by the same workflow task."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        await f.completed(dep, "s1", hotLoadId="h1")
        await f.completed(dep, "s2", hotLoadId="h2", **delta_body("s1"))
        scheduled: list[tuple[str, int]] = []
        admissions: list[list[tuple[str, int]]] = []  # each hot-load's, up to its start
        async for event in f.deployment_handle(dep).fetch_history_events():
            if event.HasField("workflow_execution_update_accepted_event_attributes"):
                scheduled = []
            attrs = event.activity_task_scheduled_event_attributes
            if event.HasField("activity_task_scheduled_event_attributes"):
                scheduled.append((attrs.activity_type.name, attrs.workflow_task_completed_event_id))
            if event.HasField("start_child_workflow_execution_initiated_event_attributes"):
                admissions.append(scheduled)
        assert len(admissions) == 2, admissions
        for scheduled in admissions:
            assert sorted({name for name, _ in scheduled}) == [names.CHECK_SNAPSHOT, names.START_REPLICAS], scheduled
            assert len({task for _, task in scheduled}) == 1, scheduled


async def test_a_lost_replica_is_reported_before_a_missing_snapshot(temporal_env, tmp_path):
    """Both checks fail at once: the caller sees the replica's, as when they ran in turn."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        members = await f.members_losing(dep, 1)
        write_full(f.bucket_root / f"ckpt/{dep}", "s1", missing=("config.json",))
        error(await f.create_hot_load(dep, "s1"), 412, "failed_precondition", "STATUS_UPDATING", members[1])
        await no_hot_load_started(f, dep)
