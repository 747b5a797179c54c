"""What the agent and the engine agree on to start an engine (neither imports the other).

The agent (`replica.agent.engine_process.EngineProcess`) runs ``python -m SERVER_MODULE`` (or
``DYNAMO_WORKER_MODULE`` for Dynamo's worker, `replica.agent.dynamo.DynamoEngineProcess`) with
``--worker-extension-cls EXTENSION_CLS`` and hands the engine its secret through a 0600 file
named by the environment variable ``SECRET_FILE_ENV``, which the engine
(`replica.engine.guard.read_secret_file`) reads at start. A Dynamo worker gets its deployment's
request-plane secret the same way, through ``REQUEST_SECRET_FILE_ENV``. ``NODE_ADDRESS_ENV`` carries the
address other hosts reach this host at: the engine's peer broadcast binds its gloo device there
(`replica.engine.peer_group`). A CPU engine started with ``ROUTED_EXPERTS_FLAG`` runs vLLM's Model
Runner V2 with Triton's interpreter: the agent puts ``TRITON_INTERPRETER_DIR`` (a folder holding
the ``sitecustomize`` that lets vLLM's CPU build accept Triton) first on its ``PYTHONPATH``.
"""

from pathlib import Path

from common import envs

SERVER_MODULE = "replica.engine.server"
# A dynamo-vllm replica's engine: Dynamo's vLLM worker with our routes (replica.agent.dynamo).
DYNAMO_WORKER_MODULE = "replica.engine.dynamo_worker"
EXTENSION_CLS = "replica.engine.extension.WeightLoaderExtension"
SECRET_FILE_ENV = envs.ROLLOUTS_ENGINE_SECRET_FILE.name
# A Dynamo worker's request-plane secret (the same for every replica of its deployment): the
# annotation every inference request must carry (common.dynamo_planes.request_annotation).
REQUEST_SECRET_FILE_ENV = envs.ROLLOUTS_REQUEST_SECRET_FILE.name
NODE_ADDRESS_ENV = envs.ROLLOUTS_NODE_ADDRESS.name
# vLLM's flag (runtime.engineConfig "enable-return-routed-experts"): routed experts per choice.
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
TRITON_INTERPRETER_DIR = Path(__file__).resolve().parent / "engine" / "triton_interpreter"
