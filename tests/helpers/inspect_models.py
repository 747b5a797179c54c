"""Write vLLM's model-class records (``modelinfos``) of every architecture the suite's engines
serve into the session's shared engine cache, in one process: ``python -m
tests.helpers.inspect_models CACHE_DIR``.

An engine that finds no record for its architecture inspects the class in a child process that
imports vLLM's model modules again (about 7 s of a core); this process imports them once for all
eight architectures (about 11 s), while the suite's first stacks start. Each record is vLLM's own
(its registry's cache functions, the file name and the source hash it checks), written to
``CACHE_DIR/inspecting/modelinfos`` and then renamed into ``CACHE_DIR/modelinfos``, so an engine
reads a whole record or none (and then inspects the class itself, as without this step).
Tests only: it uses private parts of vLLM's registry, and any failure here only costs that time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vllm.model_executor.models import registry

from workers.families import FAMILIES

# The families' architectures (workers/families.py; the base model's, Llama, is one of them).
ARCHITECTURES = sorted({model_class.__name__ for _, model_class, _ in FAMILIES.values()})


def main(cache_dir: Path) -> int:
    scratch = cache_dir / "inspecting"
    os.environ["VLLM_CACHE_ROOT"] = str(scratch)  # vLLM reads it when its registry saves a record
    shared = cache_dir / "modelinfos"
    shared.mkdir(mode=0o700, parents=True, exist_ok=True)  # as the engines make it (private)
    for arch in ARCHITECTURES:
        model = registry.ModelRegistry.models[arch]
        source = Path(registry.__file__).parent / f"{model.module_name.rsplit('.', 1)[-1]}.py"
        name = model._get_cache_filename()
        if (shared / name).exists():
            continue
        digest = model._get_modelinfo_module_hash(source)
        model._save_modelinfo_to_cache(registry._ModelInfo.from_model_cls(model.load_model_cls()), digest)
        os.replace(scratch / "modelinfos" / name, shared / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
