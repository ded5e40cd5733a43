"""The offline tiny model: deterministic, self-consistent, and built only once per cache dir.

No vLLM engine here (engine tests live elsewhere); these run in a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig

from bridge_server.tools.tiny_model import (
    TINY_MODEL_VERSION,
    default_model_dir,
    ensure_tiny_model,
    main,
    make_tiny_model,
)

REPO = Path(__file__).resolve().parents[2]


def _digests(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    return make_tiny_model(out, lora_dir=out / "lora")


def test_two_builds_are_byte_identical(built: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "again", lora_dir=tmp_path / "again" / "lora")
    a, b = _digests(built), _digests(other)
    assert {"config.json", "model.safetensors", "tokenizer.json", "lora/adapter_model.safetensors"} <= set(a)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


def test_seed_changes_weights(built: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "s1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (built / "model.safetensors").read_bytes()


def test_config_fields(built: Path) -> None:
    cfg = LlamaConfig.from_pretrained(built)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 256, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 4, 1024)
    assert cfg.max_position_embeddings == 2048
    assert cfg.hidden_size // cfg.num_attention_heads >= 32  # vLLM's CPU attention minimum
    weights = load_file(str(built / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (1024, 128)
    assert json.loads((built / "tiny_model.json").read_text())["version"] == TINY_MODEL_VERSION


def test_tokenizer_round_trip_and_special_ids(built: Path) -> None:
    tok = AutoTokenizer.from_pretrained(built)
    cfg = LlamaConfig.from_pretrained(built)
    assert len(tok) == 1024
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    for text in ("The cat sees a message today.", "héllo 😀 {:ok, pid} 12345"):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.unk_token_id not in ids  # byte-level: nothing is unknown
        assert tok.decode(ids, skip_special_tokens=True) == text
    # The training corpus should have taught it whole common words.
    assert len(tok("The cat sees a message today.", add_special_tokens=False)["input_ids"]) <= 8
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_lora_adapter(built: Path) -> None:
    cfg = json.loads((built / "lora" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (8, 16, ["q_proj", "v_proj"])
    assert cfg["bias"] == "none" and cfg["modules_to_save"] is None and cfg["fan_in_fan_out"] is False
    tensors = load_file(str(built / "lora" / "adapter_model.safetensors"))
    expected = {f"base_model.model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight"
                for i in range(2) for p in ("q_proj", "v_proj") for ab in "AB"}
    assert set(tensors) == expected
    for key, t in tensors.items():
        assert t.dtype == torch.float32
        assert t.shape == ((8, 128) if ".lora_A." in key else (128, 8)), key
        assert t.abs().sum() > 0, key  # a zero B would make the adapter a no-op


def test_ensure_builds_once_and_reuses(tmp_path: Path) -> None:
    dest = tmp_path / "cache" / "m"
    assert ensure_tiny_model(dest) == dest
    first = (dest / "model.safetensors").stat()
    assert (dest / "lora" / "adapter_config.json").is_file()
    assert ensure_tiny_model(dest) == dest
    again = (dest / "model.safetensors").stat()
    assert (first.st_ino, first.st_mtime_ns) == (again.st_ino, again.st_mtime_ns)
    assert [p.name for p in dest.parent.iterdir()] == ["m"]  # no temp dirs left behind


def test_ensure_adds_lora_later(tmp_path: Path) -> None:
    dest = ensure_tiny_model(tmp_path / "m", with_lora=False)
    assert not (dest / "lora").exists()
    before = (dest / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(dest, with_lora=True)
    assert (dest / "lora" / "adapter_model.safetensors").is_file()
    assert (dest / "model.safetensors").stat().st_mtime_ns == before
    assert sorted(p.name for p in dest.iterdir() if p.name.startswith(".")) == []


def test_ensure_replaces_stale_or_partial_dir(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "config.json").write_text("{}")  # a half-written build, no marker
    ensure_tiny_model(dest)
    assert LlamaConfig.from_pretrained(dest).hidden_size == 128
    (dest / "tiny_model.json").write_text('{"version": "old"}')
    ensure_tiny_model(dest)
    assert json.loads((dest / "tiny_model.json").read_text())["version"] == TINY_MODEL_VERSION


def test_ensure_is_safe_when_processes_race(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    code = "import sys; from bridge_server.tools.tiny_model import ensure_tiny_model as e; print(e(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(dest)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == str(dest)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert sorted(p.name for p in dest.iterdir() if p.name.startswith(".")) == []
    reference = make_tiny_model(tmp_path / "ref", lora_dir=tmp_path / "ref" / "lora")
    assert _digests(dest) == _digests(reference)


def test_default_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_BRIDGE_MODEL_DIR", str(tmp_path / "x"))
    assert default_model_dir() == tmp_path / "x"
    monkeypatch.delenv("VLLM_BRIDGE_MODEL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert default_model_dir() == tmp_path / "c" / "vllm-bridge" / "models" / f"tiny-llama-{TINY_MODEL_VERSION}"


def test_main_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "m"), "--lora", str(tmp_path / "l"), "--seed", "3"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "m"), str(tmp_path / "l")]
    assert json.loads((tmp_path / "m" / "tiny_model.json").read_text())["seed"] == 3
    assert (tmp_path / "l" / "adapter_model.safetensors").is_file()


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)
