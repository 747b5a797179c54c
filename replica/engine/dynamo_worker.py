"""A replica of a ``dynamo-vllm`` deployment: NVIDIA Dynamo's vLLM worker, launched by us::

    python -m replica.engine.dynamo_worker <python -m dynamo.vllm arguments>

Runs ``dynamo.vllm``'s own ``main()`` after `dynamo_compat`, `dynamo_routes.install` and
`dynamo_card.install`, with the engine's and the request plane's secrets read from the files
named by ``$ROLLOUTS_ENGINE_SECRET_FILE`` / ``$ROLLOUTS_REQUEST_SECRET_FILE``;
``ROLLOUTS_GATED=1`` starts it gated. Invariant: everything is imported under the ``__main__``
guard, because vLLM's spawned engine core and workers re-import this module and must not import
Dynamo (one of its modules raises on inspection without NIXL).

The cyclic garbage collector is off while vLLM and Dynamo are imported (a fifth of the import's
CPU time went to its passes over the million objects it creates): here until the imports are
done, and in vLLM's spawned processes, which import vLLM as they unpickle their target, until
vLLM loads its general plugins (`replica.engine.plugin.register` turns it back on).
"""

import gc

if __name__ == "__mp_main__":  # an engine core or a rank vLLM spawned: it imports vLLM next
    gc.disable()

if __name__ == "__main__":
    gc.disable()
    # isort: off
    import replica.engine.dynamo_compat  # noqa: F401 - before any of Dynamo's modules
    import dynamo.vllm.main as worker_main
    from dynamo.vllm.worker_factory import WorkerFactory

    # isort: on
    from common import envs
    from replica.engine import dynamo_card, dynamo_routes
    from replica.engine.guard import read_secret_file

    gc.enable()

    dynamo_routes.install(
        WorkerFactory,
        read_secret_file(),
        gated=envs.ROLLOUTS_GATED.get(),
        request_secret=read_secret_file(var=envs.ROLLOUTS_REQUEST_SECRET_FILE),
    )
    dynamo_card.install(worker_main)
    worker_main.main()
