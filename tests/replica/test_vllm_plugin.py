"""replica.engine.plugin: the capped idle busy-poll, the eager logprob ranks and vocabulary masks
(the engine side: tests/replica/test_engine.py; at tensor-parallel size 2, nothing compiled:
tests/helpers/family_chain.py)."""

from __future__ import annotations

import gc

import pytest
import torch
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.model_executor.layers import vocab_parallel_embedding
from vllm.utils.network_utils import get_open_zmq_ipc_path
from vllm.v1.sample import sampler
from vllm.v1.sample.ops import logprobs

from replica.engine.plugin import (
    DEFAULT_SPIN_S,
    count_at_least,
    eager_logprob_ranks,
    eager_vocab_masks,
    idle_spin_cap,
    logprob_ranks_eager,
    register,
    shorten_idle_spin,
    vocab_masks_eager,
)


def test_readers_stop_spinning_after_the_cap() -> None:
    assert shorten_idle_spin() is True  # a CPU platform here
    assert shorten_idle_spin() is True and idle_spin_cap() == DEFAULT_SPIN_S  # idempotent
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    assert reader.busy_loop_s == 1  # vLLM's default
    reader.wait(timeout_ms=0)
    assert reader.busy_loop_s == DEFAULT_SPIN_S
    writer.local_notify_socket.close(0)
    for sock in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket):
        sock.close(0)
    context.term()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vLLM's sampler imports torch.jit.script_method
def test_the_sampler_counts_logprob_ranks_eagerly() -> None:
    assert eager_logprob_ranks() is True and eager_logprob_ranks() is True  # a CPU platform; idempotent
    assert logprob_ranks_eager()
    assert sampler.batched_count_greater_than is count_at_least is logprobs.batched_count_greater_than
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=gen).log_softmax(-1)
    picked = torch.randint(0, 300, (5, 1), generator=gen)
    values = x.gather(-1, picked)
    x[0, :4] = values[0, 0]  # ties count (vLLM's rank: 1 + how many logits are at least as large)
    expected = torch.tensor([sum(1 for v in row if v >= values[i, 0]) for i, row in enumerate(x.tolist())])
    assert torch.equal(count_at_least(x, values), expected)


def test_the_embedding_masks_token_ids_with_vllm_s_function_uncompiled() -> None:
    compiled = vocab_parallel_embedding.get_masked_input_and_mask
    assert eager_vocab_masks() is True and eager_vocab_masks() is True  # a CPU platform; idempotent
    assert vocab_masks_eager()
    plain = vocab_parallel_embedding.get_masked_input_and_mask
    assert plain is getattr(compiled, "_torchdynamo_orig_callable", plain)  # vLLM's own function
    # A rank holding original ids 504-999 (rows 0-495, then 8 rows of padding) and added ids
    # 1002-1003 (rows 504-505); every other id is outside its shard (row 0, masked).
    ids = torch.tensor([0, 503, 504, 999, 1000, 1002, 1003], dtype=torch.int64)
    shifted, outside = plain(ids, 504, 1000, 8, 1002, 1004)
    assert shifted.tolist() == [0, 0, 0, 495, 0, 504, 505]
    assert outside.tolist() == [True, True, False, False, True, False, False]


def test_register_turns_the_garbage_collector_back_on() -> None:
    """A process vLLM spawned from our Dynamo worker imports vLLM with it off (dynamo_worker.py)."""
    gc.disable()
    try:
        register()
        assert gc.isenabled()
    finally:
        gc.enable()
