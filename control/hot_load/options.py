"""Activity options of the hot-load walk: how long each replica step may take and what is retried.

A bucket step (`apply_snapshot`) retries what can heal and fails at once on what the same
snapshot would fail again (a wrong snapshot, a failed in-pause read-back, an injected fault); a
peer step is tried once (the bucket is the retry). Every step heartbeats and waits for its
cancellation to complete, so a canceled step reports back only once its replica serves the old
or the new weights, never a mix.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from contracts.errors import INJECTED_FAULT, NON_RETRYABLE_SNAPSHOT, READ_BACK_FAILED

REPLICA_STEP_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
    non_retryable_error_types=[NON_RETRYABLE_SNAPSHOT, READ_BACK_FAILED, INJECTED_FAULT],
)

REPLICA_STEP: dict[str, Any] = dict(
    start_to_close_timeout=timedelta(minutes=15),
    # A step that no agent picks up means the replica is gone; a lost replica is restarted by its
    # deployment within seconds and needs a minute or two to start and catch up.
    schedule_to_start_timeout=timedelta(minutes=10),
    heartbeat_timeout=timedelta(seconds=30),
    retry_policy=REPLICA_STEP_RETRY,
    cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
)

PEER_STEP: dict[str, Any] = dict(
    start_to_close_timeout=timedelta(minutes=10),
    schedule_to_start_timeout=timedelta(minutes=1),
    heartbeat_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(maximum_attempts=1),
    cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
)
