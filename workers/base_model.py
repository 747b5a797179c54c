"""The embedded stack's base model, generated locally (no model hub here).

``write_base_model(out_dir, seed=0)`` writes a small Llama-architecture checkpoint (BF16, two
shards, a byte-level BPE tokenizer trained here with a chat template); the same seed gives
byte-identical files. ``write_counting_model(base_dir, out_dir)`` writes a FULL checkpoint of
the same layout whose greedy continuation of token ``i`` is ``i + 1`` (mod vocab), so a
hot-load changes greedy output predictably; ``counting_tensors`` returns only the tensors that
differ (``COUNTING_CHANGED``). Why it counts: with every ``o_proj`` and ``down_proj`` at zero the
last hidden state is the token's own embedding, and ``lm_head[j] = scale * e_{j-1}`` over
near-orthogonal unit embeddings makes logit ``i + 1`` win by a margin (``COUNTING_SCALE``: ~32)
far above BF16 rounding. CLI: ``python -m workers.base_model OUT [--counting] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64  # vLLM's CPU attention backend rejects small head sizes such as 16
LAYERS = 4
INTERMEDIATE = 688
VOCAB = 2048
MAX_POSITIONS = 2048
COUNTING_SCALE = 2.0

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Special tokens take the first ids, in this order: pad 0, bos 1, eos 2, then the chat roles.
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SHARDS = 2
INDEX_NAME = "model.safetensors.index.json"

# The tensors in which the counting model differs from the base model.
COUNTING_CHANGED: tuple[str, ...] = (
    *(f"model.layers.{i}.self_attn.o_proj.weight" for i in range(LAYERS)),
    *(f"model.layers.{i}.mlp.down_proj.weight" for i in range(LAYERS)),
    "model.norm.weight",
    "lm_head.weight",
)


def shard_name(i: int, n: int = SHARDS) -> str:
    """HF's shard naming, 1-based."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


# ---------------------------------------------------------------------------------------------
# Tokenizer: a byte-level BPE trained on a synthetic corpus (English-ish text and arithmetic).

_WORDS = (
    "the of and to in is was for on that with as by at from it be this are or have an which one "
    "all were they their has been more when will would there what about if can so up out into "
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education model weight policy "
    "reward rollout train learn update step batch token sample replica engine server request "
    "good new first last long great little own other old big high different small large next "
    "early young important few public bad same able say make go know take see come think look "
    "want give use find tell ask seem feel try leave call keep let begin show hear play run move "
    "live believe hold bring happen write provide sit stand lose pay meet include continue set "
    "count add plus minus times equals answer zero one two three four five six seven eight nine "
    "ten hello world please thank you yes no maybe why how where who because while after before"
).split()
_SYLLABLES = ("ka ri to ne mu sa lo vi de pa zu fe ro gi ta mo ul an en in or ar st tr pl gr ch th sh qu").split()


def _corpus(rng: random.Random, n_lines: int = 6000) -> Iterator[str]:
    """Deterministic training text: sentences, arithmetic, numbers and pseudo-words.

    Pseudo-words keep the BPE trainer finding frequent pairs until it reaches ``VOCAB``.
    """
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    pseudo = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(600)]
    for i in range(n_lines):
        kind = i % 4
        if kind == 0:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
            yield " ".join(words).capitalize() + rng.choice([".", ".", "?", "!"])
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            sym, fn = rng.choice(ops)
            yield f"{a} {sym} {b} = {fn(a, b)}"
        elif kind == 2:
            words = [rng.choice(pseudo) for _ in range(rng.randint(3, 8))]
            yield " ".join(words) + ", " + " ".join(rng.choice(_WORDS) for _ in range(4)) + "."
        else:
            n = rng.randint(0, 10**6)
            yield f"Step {rng.randint(1, 500)}: the {rng.choice(_WORDS)} count is {n}, plus {n % 97}."


def train_tokenizer(seed: int = 0):
    """Train the byte-level BPE; returns a ``tokenizers.Tokenizer`` with exactly ``VOCAB`` ids."""
    tok = Tokenizer(models.BPE())
    # Digits one by one (so arithmetic tokenizes digit-wise), then GPT-2 style byte-level.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Plain tokenization (add_special_tokens=True) prepends <s>, as Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, expected {VOCAB}")
    return tok


def _tokenizer_config(tok) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
    }


# ---------------------------------------------------------------------------------------------
# Weights


def base_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The base model's tensors (BF16, checkpoint names), deterministic in ``seed``.

    Embedding rows are random unit vectors (so the counting model can reuse them as
    near-orthogonal codes); linear weights are N(0, 0.02) as in HF's initialisation.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).to(torch.bfloat16)

    embed = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float32)
    embed = embed / embed.norm(dim=1, keepdim=True)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed.to(torch.bfloat16)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        t[p + "self_attn.q_proj.weight"] = normal(q, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = normal(kv, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = normal(kv, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = normal(HIDDEN, q)
        t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        t[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        t[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    t["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    t["lm_head.weight"] = normal(VOCAB, HIDDEN)
    return t


def _shard_plan(names: list[str]) -> list[list[str]]:
    """Split names into ``SHARDS`` contiguous groups of about equal count (order preserved)."""
    per = math.ceil(len(names) / SHARDS)
    return [names[i : i + per] for i in range(0, len(names), per)]


def write_tensors(out_dir: Path, tensors: dict[str, torch.Tensor]) -> list[Path]:
    """Write ``tensors`` as HF sharded safetensors plus ``model.safetensors.index.json``."""
    names = list(tensors)
    groups = _shard_plan(names)
    weight_map: dict[str, str] = {}
    paths: list[Path] = []
    for i, group in enumerate(groups):
        fname = shard_name(i, len(groups))
        save_file({n: tensors[n].contiguous() for n in group}, out_dir / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        paths.append(out_dir / fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths


# The files of a checkpoint besides its tensors and index: a trainer's new checkpoint copies them.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def copy_side_files(src_dir: Path, out_dir: Path) -> None:
    """Copy ``src_dir``'s :data:`SIDE_FILES` (those it has) into ``out_dir``."""
    for name in SIDE_FILES:
        if (Path(src_dir) / name).exists():
            shutil.copy2(Path(src_dir) / name, out_dir / name)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_base_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Write the base model checkpoint (see the module docstring); returns ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", model_config())
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": SPECIAL_TOKENS.index(BOS),
            "eos_token_id": SPECIAL_TOKENS.index(EOS),
            "pad_token_id": SPECIAL_TOKENS.index(PAD),
        },
    )
    tok = train_tokenizer(seed)
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tok))
    _write_json(out_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    write_tensors(out_dir, base_tensors(seed))
    return out_dir


def load_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a sharded checkpoint, in index order."""
    model_dir = Path(model_dir)
    index = json.loads((model_dir / INDEX_NAME).read_text())
    out: dict[str, torch.Tensor] = {}
    for fname in dict.fromkeys(index["weight_map"].values()):
        out.update(load_file(model_dir / fname))
    return {n: out[n] for n in index["weight_map"]}


def counting_tensors(base_dir: Path, *, scale: float = COUNTING_SCALE) -> dict[str, torch.Tensor]:
    """The tensors that turn the base model into the successor model (``COUNTING_CHANGED``)."""
    base = load_checkpoint(base_dir)
    embed = base["model.embed_tokens.weight"].float()
    # Row j predicts token j: it carries the code of token j-1 (row 0 the code of the last id).
    lm_head = scale * torch.roll(embed, shifts=1, dims=0)
    out: dict[str, torch.Tensor] = {}
    for name in COUNTING_CHANGED:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = torch.zeros_like(base[name])
    out["model.norm.weight"] = torch.ones_like(base["model.norm.weight"])
    out["lm_head.weight"] = lm_head.to(torch.bfloat16)
    return out


def write_counting_model(base_dir: Path, out_dir: Path, *, scale: float = COUNTING_SCALE) -> Path:
    """Write the full counting checkpoint (base config/tokenizer, same shard layout)."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for fname in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        (out_dir / fname).write_bytes((base_dir / fname).read_bytes())
    tensors = load_checkpoint(base_dir)
    tensors.update(counting_tensors(base_dir, scale=scale))
    write_tensors(out_dir, tensors)
    return out_dir


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The shard files a checkpoint's index names, in order."""
    index = json.loads((Path(model_dir) / INDEX_NAME).read_text())
    return [Path(model_dir) / f for f in dict.fromkeys(index["weight_map"].values())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.base_model", description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--counting",
        action="store_true",
        help="write OUT/base and OUT/counting (the successor model) instead of OUT",
    )
    args = ap.parse_args(argv)
    if args.counting:
        base = write_base_model(args.out / "base", seed=args.seed)
        write_counting_model(base, args.out / "counting")
        print(f"{args.out / 'base'}\n{args.out / 'counting'}")
    else:
        print(write_base_model(args.out, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
