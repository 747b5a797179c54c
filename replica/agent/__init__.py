"""What runs in a replica's agent process (never imports `replica.engine`).

- `process`: `run_replica`, the replica process (downloads, engine start, readiness signals);
- `activities`: the Temporal activities on the replica's task queue;
- `runtime`: `ReplicaRuntime`, staging, the swap inside one pause with its proof, commit and
  roll-back, from the bucket; `peers`: offers, the broadcast, a receiver's stage and commit;
  `staged`: the records and errors of an update; `downloads`: bucket objects to local files;
- `engine`: `EngineProcess`, the engine's process; `engine_rpc`: `EngineClient`, its control
  routes and the worker extension's RPCs;
- `shm_reclaim`: shared memory dead engines left behind.
"""
