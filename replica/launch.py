"""What the agent and the engine agree on to start an engine (neither imports the other).

The module to run (``SERVER_MODULE`` or ``DYNAMO_WORKER_MODULE``), the extension
(``EXTENSION_CLS``), the variables naming the 0600 files that carry the engine's secret
(``SECRET_FILE_ENV``) and a Dynamo worker's request-plane secret (``REQUEST_SECRET_FILE_ENV``),
the node address other hosts reach (``NODE_ADDRESS_ENV``, where peer broadcasts bind), and for
a CPU engine with ``ROUTED_EXPERTS_FLAG`` the ``TRITON_INTERPRETER_DIR`` put first on its
``PYTHONPATH``.
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
