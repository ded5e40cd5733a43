"""A tiny random-weight Llama, made locally, for tests and the default server config.

These machines have no model hub, so every model the bridge serves in development has to be
built from nothing: random weights, a tokenizer trained here on text generated here, and a
rank-8 LoRA adapter written by hand (peft is not installed). Everything is seeded so that two
builds are byte-identical; that lets a cache directory be trusted and lets tests compare
outputs across machines.

Layout of a built directory (``ensure_tiny_model``)::

    <dir>/config.json, generation_config.json, model.safetensors   the model
    <dir>/tokenizer.json, tokenizer_config.json, ...                 the tokenizer
    <dir>/lora/adapter_config.json, adapter_model.safetensors        the LoRA adapter
    <dir>/tiny_model.json                                            marker, written last

vLLM only globs ``*.safetensors`` at the top of the model directory, so the ``lora``
subdirectory does not disturb model loading, and keeping it inside lets one atomic rename
publish model and adapter together.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

# Bump whenever the recipe (shapes, corpus, seeds, file layout) changes: the default cache path
# contains it, so an old cache is never mistaken for a new build.
TINY_MODEL_VERSION = "2"

MARKER = "tiny_model.json"
LORA_SUBDIR = "lora"
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
VOCAB_SIZE = 1024
# Room for streams long enough that a test can act on one before it ends; servers still choose their
# own max_model_len (the default pool uses 256).
MAX_POSITIONS = 2048
# Ids follow Llama's convention (unk 0, bos 1, eos 2) so Llama defaults never disagree with ours.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
# Weight init draws from torch's global RNG: two threads building at once would interleave draws
# and break byte-identical output, so builds in one process are serialized.
_BUILD_LOCK = threading.Lock()

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SUBJECTS = ("the cat", "a dog", "my friend", "the server", "an engineer", "the model", "a bird",
             "the elixir client", "our team", "the old man", "a child", "the worker", "she", "he",
             "they", "we", "the scheduler", "a process", "the river", "the city")
_VERBS = ("sees", "likes", "builds", "sends", "reads", "writes", "finds", "streams", "counts",
          "opens", "closes", "answers", "tokenizes", "generates", "watches", "carries", "calls")
_OBJECTS = ("a message", "the request", "many tokens", "a small model", "the answer", "a song",
            "the green door", "two apples", "a long story", "the queue", "some data", "the key",
            "a quiet room", "the next batch", "a red ball", "the stream", "an error", "the sky")
_TAILS = ("today", "again", "in the morning", "at night", "very quickly", "with care",
          "over the network", "before lunch", "for the user", "without a word", "on time")
_EXTRA = ("Hello, world!", "How are you?", "What is the capital of France?", "Paris is nice.",
          "def main(): return 0", "Enum.map(list, fn x -> x * 2 end)", "{:ok, pid}",
          "GenServer.call(pid, :ping)", "Once upon a time, there was a tiny model.",
          "User: hi\nAssistant: hello", "1 + 1 = 2", "The quick brown fox jumps over the lazy dog.")


def _corpus(seed: int, n: int = 4000) -> list[str]:
    """Deterministic text: common words become whole tokens, made-up names fill the vocab."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
    lines = list(_EXTRA)
    for _ in range(n):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.6:
            s += f" {rng.choice(_TAILS)}"
        if rng.random() < 0.5:
            s += " near " + "".join(rng.choices(syllables, k=rng.randint(2, 4))).capitalize()
        if rng.random() < 0.2:
            s += f" {rng.randint(0, 9999)} times"
        s = s[0].upper() + s[1:] + rng.choice((".", ".", "!", "?"))
        lines.append(s)
    return lines


def _build_tokenizer(out_dir: Path, seed: int) -> None:
    """Train a byte-level BPE so any text (code, emoji) encodes without <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    # Training is deterministic even with parallel word counting (merge ties are broken by pair
    # order, ids assigned in merge order); tests/tools/test_tiny_model.py checks this byte for byte.
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    # Prepend <s> like Llama's tokenizer, so vLLM prompts start the same way real models do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE, model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out_dir))


def _build_model(out_dir: Path, seed: int) -> None:
    """Random Llama; head_dim 32 because vLLM's CPU attention rejects anything smaller."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        tie_word_embeddings=False, dtype="float32")
    # fork_rng: seeding must not leak into the caller's global RNG (tests seed their own).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()  # float32 even if the caller changed the default
    model.save_pretrained(str(out_dir), safe_serialization=True)


def _write_lora(lora_dir: Path, seed: int, base_name: str) -> None:
    """A peft-format adapter written by hand; B is non-zero (unlike peft's init) so it matters."""
    import torch
    from safetensors.torch import save_file

    hidden, layers = 128, 2
    gen = torch.Generator().manual_seed(seed + 1)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for proj in LORA_TARGETS:
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            a = torch.randn(LORA_RANK, hidden, generator=gen) / hidden**0.5
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = torch.randn(hidden, LORA_RANK, generator=gen) * 0.1
    lora_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(lora_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": LORA_ALPHA,
        "target_modules": list(LORA_TARGETS), "base_model_name_or_path": base_name,
        "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False, "modules_to_save": None,
        "inference_mode": True, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (lora_dir / "adapter_config.json").write_text(text)


def make_tiny_model(out_dir: Path, *, lora_dir: Path | None = None, seed: int = 0) -> Path:
    """Build into ``out_dir`` (not atomically; ``ensure_tiny_model`` adds that) and return it.

    The marker is written last, so its presence means the build finished. The adapter's
    ``base_model_name_or_path`` is a fixed name, not ``out_dir``, so the bytes do not depend on
    where the build ran.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _BUILD_LOCK:
        _build_model(out_dir, seed)
        _build_tokenizer(out_dir, seed)
        if lora_dir is not None:
            _write_lora(Path(lora_dir), seed, f"tiny-llama-{TINY_MODEL_VERSION}")
    marker = {"version": TINY_MODEL_VERSION, "seed": seed}
    (out_dir / MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
    return out_dir


def default_model_dir() -> Path:
    """``$VLLM_BRIDGE_MODEL_DIR``, else a versioned folder in the user cache all clones share."""
    env = os.environ.get("VLLM_BRIDGE_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "vllm-bridge" / "models" / f"tiny-llama-{TINY_MODEL_VERSION}"


def _is_built(d: Path) -> bool:
    try:
        return bool(json.loads((d / MARKER).read_text()).get("version") == TINY_MODEL_VERSION)
    except (OSError, ValueError):
        return False


def _publish(tmp: Path, dest: Path, done: Callable[[], bool]) -> None:
    """Rename ``tmp`` onto ``dest``; losing a race to an equal build is success, not an error.

    ``done`` is asked only after a failed rename, because the winner may have landed just now.
    """
    try:
        os.rename(tmp, dest)  # atomic; replaces ``dest`` only if it is an empty directory
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done():
            raise


def ensure_tiny_model(out_dir: Path | None = None, *, with_lora: bool = True) -> Path:
    """Return a built model dir, building it once; safe when several processes race.

    Each builder works in its own temporary sibling and renames it into place, so readers never
    see a half-written folder. A folder from another recipe version is swapped out, not patched.
    The adapter, if asked for, lives in ``<dir>/lora``.
    """
    dest = Path(out_dir) if out_dir is not None else default_model_dir()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not _is_built(dest):
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-", dir=dest.parent))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would make a shared cache unreadable to others
        try:
            make_tiny_model(tmp, lora_dir=tmp / LORA_SUBDIR if with_lora else None)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if dest.exists() and not _is_built(dest) and any(dest.iterdir()):
            # Stale or foreign contents: move aside so the rename below can land.
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            try:
                os.rename(dest, old / "d")
            except OSError:
                pass  # someone else moved it first
            shutil.rmtree(old, ignore_errors=True)
        _publish(tmp, dest, lambda: _is_built(dest))
    if with_lora and not (dest / LORA_SUBDIR / "adapter_config.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".{LORA_SUBDIR}.build-", dir=dest))
        os.chmod(tmp, 0o755)
        _write_lora(tmp, 0, f"tiny-llama-{TINY_MODEL_VERSION}")
        _publish(tmp, dest / LORA_SUBDIR, (dest / LORA_SUBDIR / "adapter_config.json").exists)
    return dest


def main(argv: list[str] | None = None) -> int:
    """``vllm-bridge make-tiny-model DIR [--lora DIR] [--seed N]``."""
    parser = argparse.ArgumentParser(
        prog="vllm-bridge make-tiny-model",
        description="Build the tiny random-weight Llama (and optionally its LoRA) offline.")
    parser.add_argument("dir", type=Path, help="output folder for model and tokenizer")
    parser.add_argument("--lora", type=Path, default=None, help="also write a LoRA adapter here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = make_tiny_model(args.dir, lora_dir=args.lora, seed=args.seed)
    print(path)
    if args.lora is not None:
        print(args.lora)
    return 0


if __name__ == "__main__":
    sys.exit(main())
