"""Which links of a resolved chain admission checks in the bucket (control/admission.py
`links_to_check`): the new one, and each earlier one a replica will read because it does not
serve it yet; a replica serving no link of the chain reads all of it."""

from __future__ import annotations

from contracts.records import ReplicaEndpoint, SnapshotRef, SnapshotType
from control.admission import links_to_check
from tests.helpers.workflow_checks import deployment_state

CHAIN = [SnapshotRef(identity="s0", type=SnapshotType.FULL)] + [
    SnapshotRef(identity=f"s{i}", type=SnapshotType.INCREMENTAL) for i in range(1, 5)
]


def checked(*served: str) -> list[str]:
    state = deployment_state("d", zones=["Z"])
    state.replicas = [
        ReplicaEndpoint(
            name=f"r{i}",
            zone="Z",
            task_queue="q",
            engine_url="u",
            engine_pid=1,
            agent_pid=1,
            current_snapshot_identity=identity,
        )
        for i, identity in enumerate(served)
    ]
    return [link.identity for link in links_to_check(state, CHAIN)]


def test_a_delta_on_what_every_replica_serves_checks_only_itself():
    assert checked("s3", "s3", "s3") == ["s4"]
    assert checked() == ["s4"]


def test_a_replica_behind_reads_the_links_after_what_it_serves():
    assert checked("s3", "s1") == ["s2", "s3", "s4"]
    assert checked("s3", "s0") == ["s1", "s2", "s3", "s4"]


def test_a_replica_on_none_of_the_chain_reads_all_of_it():
    assert checked("s3", "initial") == ["s0", "s1", "s2", "s3", "s4"]
    assert checked("s3", "other") == ["s0", "s1", "s2", "s3", "s4"]


def test_a_replica_that_already_serves_the_new_link_reads_nothing():
    assert checked("s4", "s3") == ["s4"]
