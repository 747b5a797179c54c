"""How often the base model follows the counting rule (token = previous + 1) by chance.

    .venv/bin/python bench/base_counting.py [--answers 480] [--tokens 900]

The weight-version tests (tests/gateway/test_weight_versions.py, test_weight_spans.py,
test_on_policy.py) tell the counting model's tokens from the base model's by that rule, so their
premise is how the base model behaves: this writes the embedded base model, answers ``--answers``
random 6-token prompts greedily (``ignore_eos``, as the tests ask) with an offline vLLM engine,
and prints per answer how many tokens count and the longest run of counting tokens in a row,
then how many answers a check would wrongly fail: "fewer than 8 tokens count" (what the tests
once asked) against "no 3 in a row count" (``tests.helpers.gateway.CHANCE_RUN``). Greedy
answers of a random small model settle into short loops, and a loop holding one +1 step counts
once per turn: many isolated tokens, never a run. Measured figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from tests.helpers.gateway import CHANCE_RUN, longest_run, succession  # noqa: E402
from workers.base_model import VOCAB, write_base_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--answers", type=int, default=480)
    ap.add_argument("--tokens", type=int, default=900)
    ap.add_argument("--seed", type=int, default=1234, help="of the prompts")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_base_model(Path(tmp) / "base")
        llm = LLM(model=str(model), enforce_eager=True, max_model_len=1024, dtype="bfloat16", seed=0)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(10, 2000) for _ in range(6)] for _ in range(args.answers)]
        started = time.monotonic()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
        )
        took = time.monotonic() - started
    sums, longest = [], []
    for p, o in zip(prompts, outs):
        counts = succession(p[-1], list(o.outputs[0].token_ids))
        sums.append(sum(counts))
        longest.append(longest_run(counts))
    total = args.answers * args.tokens
    print(f"{args.answers} greedy answers of {args.tokens} tokens ({total:,} tokens, {took:.0f} s)")
    print(f"tokens that count: {sum(sums):,} (1 in {total / max(1, sum(sums)):,.0f}; uniform chance is 1 in {VOCAB})")
    print(f"answers by tokens that count: {dict(sorted(collections.Counter(sums).items()))}")
    print(f"answers by longest run: {dict(sorted(collections.Counter(longest).items()))}")
    print(
        f"a check of 'fewer than 8 count' fails {sum(s >= 8 for s in sums)} of {args.answers}; "
        f"of 'no {CHANCE_RUN} in a row' {sum(r >= CHANCE_RUN for r in longest)} of {args.answers}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
