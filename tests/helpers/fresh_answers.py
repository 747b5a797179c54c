"""Greedy answers of fresh vLLM engines, one per checkpoint, as a deployment's engine would give
them right after it started on that checkpoint: the reference of the family chain
(tests/helpers/family_chain.py) after a hot-load.

    python -m tests.helpers.fresh_answers OUT.json REQUEST_JSON CHECKPOINT [CHECKPOINT ...] -- ENGINE_FLAGS

``answers`` (run in a process of its own, with the environment ``FreshAnswers`` gives it: the one
a replica's engine gets, ``replica.agent.engine_process``) builds vLLM's engine for each checkpoint
in turn from the deployment engine's flags (our worker extension included), asks it the request
(prompt token ids, greedy, logprobs) and writes, per checkpoint, the token ids, their logprobs and
the routed experts (with ``--enable-return-routed-experts``). One process for every checkpoint:
vLLM is imported once, not once per engine; the engine core runs in it
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as a one-rank replica's engine runs its worker).

``FreshAnswers`` starts that process in the background (the chain goes on meanwhile) and waits
for it when an answer is needed.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common.processes import stop_pid
from replica.agent.engine_process import INPROC_WORKER_ENV, EngineProcess, share_model_infos
from replica.agent.process import engine_options
from tests.helpers.engine_cache import model_infos


def engine_flags(engine: EngineProcess) -> list[str]:
    """vLLM's engine arguments of ``engine``'s command (``EngineProcess.command`` and Dynamo's
    worker alike), without the server's own (host, port, served name)."""
    flags = [
        "--dtype",
        engine.dtype,
        "--enforce-eager",
        "--max-model-len",
        str(engine.max_model_len),
        "--max-num-seqs",
        str(engine.max_num_seqs),
    ]
    if engine.worker_extension_cls:
        flags += ["--worker-extension-cls", engine.worker_extension_cls]
    return flags + engine.kv_cache_args() + engine.extra_args


class FreshAnswers:
    """Fresh engines' answers to ``request`` on ``checkpoints``, computed in the background by a
    process started with the engine ``engine_config`` (a deployment's ``runtime.engineConfig``)
    describes; ``get(checkpoint)`` waits for them."""

    def __init__(self, checkpoints: list[Path], engine_config: dict[str, str], request: dict, work_dir: Path):
        work_dir.mkdir(parents=True, exist_ok=True)
        # The engine's own files (TMPDIR, caches) in a short directory, as a replica's: vLLM binds
        # IPC sockets under TMPDIR, and a socket path must stay under 108 bytes.
        self.engine_dir = Path(tempfile.mkdtemp(prefix="rollouts-fresh-"))
        for sub in ("tmp", "cache"):
            (self.engine_dir / sub).mkdir()
        engine = EngineProcess(checkpoints[0], work_dir=self.engine_dir, **engine_options(engine_config))
        if (shared := model_infos()) is not None:  # vLLM's record of each model class, the session's
            share_model_infos(shared, self.engine_dir / "cache" / "vllm" / "modelinfos")
        env = engine.environment()
        env[INPROC_WORKER_ENV] = "0"  # the engine core in this process: one vLLM import for all
        self.out = work_dir / "answers.json"
        self.log = work_dir / "answers.log"
        cmd = [
            sys.executable,
            "-m",
            __name__,
            str(self.out),
            json.dumps(request),
            *map(str, checkpoints),
            "--",
            *engine_flags(engine),
        ]
        with self.log.open("wb") as log:
            # A process group of its own: its engines' workers (tensor parallel) stop with it.
            self.proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._answers: dict[str, dict] | None = None

    def _of(self, checkpoint: Path) -> dict:
        if self._answers is None:
            rc = self.proc.wait(timeout=900)
            assert rc == 0, f"the fresh engines failed ({rc}):\n{self.log.read_text()[-4000:]}"
            self._answers = json.loads(self.out.read_text())
        return self._answers[str(checkpoint)]

    def answer(self, checkpoint: Path) -> tuple[list[int], list[float]]:
        """The fresh engine's greedy token ids and their logprobs on ``checkpoint``."""
        found = self._of(checkpoint)
        return found["token_ids"], found["logprobs"]

    def routes(self, checkpoint: Path) -> list:
        """Its token ids and routed experts (``[prompt + completion - 1, layers, top_k]``), as lists."""
        found = self._of(checkpoint)
        return [found["token_ids"], found["routes"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            stop_pid(self.proc.pid, timeout=5)
            self.proc.wait()
        shutil.rmtree(self.engine_dir, ignore_errors=True)


def answers(checkpoints: list[str], flags: list[str], request: dict) -> dict[str, list]:
    """Each checkpoint's greedy answer from an engine built fresh on it (see the docstring)."""
    # vLLM, only in this process of its own; imported with the collector off, as a replica's
    # engine imports it (replica/engine/dynamo_worker.py: ~20 % of the import's CPU).
    gc.disable()
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.distributed import cleanup_dist_env_and_memory  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    gc.enable()

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    params = SamplingParams(
        temperature=0, max_tokens=request["max_tokens"], logprobs=1, ignore_eos=request.get("ignore_eos", False)
    )
    found = {}
    for checkpoint in checkpoints:
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(["--model", checkpoint, *flags])))
        [out] = llm.generate([{"prompt_token_ids": request["prompt"]}], params, use_tqdm=False)
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        routes = completion.routed_experts
        found[checkpoint] = {
            "token_ids": ids,
            "logprobs": [float(step[t].logprob) for t, step in zip(ids, completion.logprobs, strict=True)],
            "routes": None if routes is None else routes.tolist(),
        }
        del llm, out, completion
        gc.collect()
        cleanup_dist_env_and_memory()
    return found


def main(argv: list[str]) -> int:
    split = argv.index("--")
    out, request, checkpoints, flags = Path(argv[0]), json.loads(argv[1]), argv[2:split], argv[split + 1 :]
    found = answers(checkpoints, flags, request)
    out.write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    os.environ.setdefault(INPROC_WORKER_ENV, "0")
    sys.exit(main(sys.argv[1:]))
