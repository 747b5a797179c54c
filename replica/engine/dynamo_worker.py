"""A replica of a ``dynamo-vllm`` deployment: NVIDIA Dynamo's vLLM worker, launched by us::

    python -m replica.engine.dynamo_worker <python -m dynamo.vllm arguments>

Runs ``dynamo.vllm``'s own ``main()`` after `dynamo_compat`, `dynamo_routes.install` and
`dynamo_card.install`, with the engine's and the request plane's secrets read from the files
named by ``$ROLLOUTS_ENGINE_SECRET_FILE`` / ``$ROLLOUTS_REQUEST_SECRET_FILE``;
``ROLLOUTS_GATED=1`` starts it gated. Invariant: everything is imported under the ``__main__``
guard, because vLLM's spawned engine core and workers re-import this module and must not import
Dynamo (one of its modules raises on inspection without NIXL).
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
