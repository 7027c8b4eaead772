"""Sharded loading (relayrl.models.empty + relayrl.distributed.sharded_load) on 2 real gloo CPU ranks
(torch.multiprocessing): the model built empty, sharded by FSDP2 and filled from each rank's own rows equals
the old path (whole model loaded on every rank, then sharded) BIT FOR BIT (fp32 and bf16 parameters, buffers,
trainability, the tied head, the config, the logits), for a tied and an untied Qwen2 (the untied one saved in
bf16: the fill casts), a critic (new zero head), a reward model (new N(0, 1/(H+1)) head drawn with the same
seeded RNG), a saved value-head folder, and Qwen3-MoE / Mixtral (fused experts from per-expert tensors, 3
experts: uneven shards). Each rank reads its share of the checkpoint (bytes counted) and, on a ~50 MB model,
adds at most 0.7x the model's size to its peak host memory (the old path: the whole model). One spawn of 2
ranks runs every case (~3-6 s on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sharded_load_ranks as ranks
import torch
from rank_spawn import spawn_ranks
from safetensors import safe_open

from relayrl.config.components import LoraConfig, ModelConfig
from relayrl.models.empty import Built, Unsupported, empty_causal_lm, empty_value_model
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer, save_tiny
from relayrl.models.tiny_vlm import save_tiny_vlm
from relayrl.models.value_head import build_value_model, save_value_model


def _untied_bf16(path: Path) -> Path:
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, TinyModelSpec(hidden=32, layers=2, seed=3))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape))
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _value_folder(path: Path, base: Path) -> Path:
    model = build_value_model(ModelConfig(name_or_path=str(base)), init="normal")
    return save_value_model(model, build_tiny_tokenizer(), path)


def _checkpoint_bytes(folder: str) -> int:
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sharded_load")
    dense = save_tiny(root / "dense", TinyModelSpec(hidden=32, layers=2, seed=1))
    return {
        "dense": str(dense),
        "untied": str(_untied_bf16(root / "untied")),
        "value": str(_value_folder(root / "value", dense)),
        "qwen3": str(save_tiny(root / "qwen3", TinyModelSpec(hidden=32, layers=2, moe="qwen3", experts=3))),
        "mixtral": str(
            save_tiny(root / "mixtral", TinyModelSpec(hidden=32, layers=2, moe="mixtral", experts=3))
        ),
    }


def _spawn(fn: Any, tmp_path: Path, *args: Any) -> None:
    spawn_ranks(fn, (2, str(tmp_path / "store"), str(tmp_path), *args), nprocs=2)


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory) -> str:
    """A ~50 MB fp32 model (3 layers of hidden 512, MLP 2048)."""
    spec = TinyModelSpec(hidden=512, layers=3, heads=8, kv_heads=8, intermediate=2048, seed=0)
    return str(save_tiny(tmp_path_factory.mktemp("big") / "model", spec))


@pytest.mark.slow  # 2 spawned ranks, ~3-6 s on 2 cores
def test_sharded_load_equals_the_old_path_and_holds_only_a_share(folders, big_folder, tmp_path):
    cases = [
        {"kind": "lm", "folder": folders["dense"]},
        {"kind": "lm", "folder": folders["dense"], "dtype": "bf16"},  # a reference on a GPU: bf16 shards
        {"kind": "lm", "folder": folders["untied"]},
        {"kind": "value", "folder": folders["dense"], "init": "zeros"},  # the critic
        {"kind": "value", "folder": folders["dense"], "init": "normal"},  # a new reward model
        {"kind": "value", "folder": folders["value"], "init": "normal"},  # a saved value-head folder
        {"kind": "lm", "folder": folders["qwen3"]},
        {"kind": "lm", "folder": folders["mixtral"]},
    ]
    _spawn(ranks.rank_main, tmp_path, cases, big_folder)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for i, case in enumerate(cases):
        old, new = results[0][i]["old"], results[0][i]["new"]
        assert list(new["params"]) == list(old["params"]), case
        for name, t in old["params"].items():
            assert t.dtype == new["params"][name].dtype and torch.equal(t, new["params"][name]), (case, name)
        assert list(new["buffers"]) == list(old["buffers"]) and old["buffers"], case
        for name, b in old["buffers"].items():
            assert b.dtype == new["buffers"][name].dtype and torch.equal(b, new["buffers"][name]), (
                case,
                name,
            )
        assert new["requires_grad"] == old["requires_grad"] and new["dtype"] == old["dtype"], case
        tied = case["kind"] == "lm" and case["folder"] != folders["untied"]
        assert new["tied"] == old["tied"] == tied, case
        assert new["config"] == old["config"] and new["training"] == old["training"], case
        for r in range(2):
            old_logits, new_logits = results[r][i]["logits"]
            assert torch.equal(old_logits, new_logits), case
        # together the ranks read the checkpoint once: each about half (rows of 101-token embeddings split 51
        # / 50; 3 experts split 2 / 1, so a MoE rank reads up to 2/3)
        total = _checkpoint_bytes(case["folder"])
        read = [results[r][i]["bytes_read"] for r in range(2)]
        assert all(0 < b < 0.68 * total for b in read), (case, read, total)
        assert sum(read) == total, (case, read, total)
    # the reward model's new head is random and the same on both paths; the critic's is zero
    assert results[0][4]["new"]["params"]["score.weight"].abs().sum() > 0
    assert results[0][3]["new"]["params"]["score.weight"].abs().sum() == 0
    # host memory: the peak a rank adds while loading the ~50 MB model (Linux VmHWM, reset before)
    total_mb = _checkpoint_bytes(big_folder) / 2**20
    assert total_mb > 45
    for r in range(2):
        mem = torch.load(tmp_path / f"mem{r}.pt")
        assert mem["new"]["bytes_read"] / 2**20 < 0.55 * total_mb, (mem, total_mb)
        # measured (48.2 MB model): new 29.5-30.9 MB = 0.61-0.64x (its fp32 half, 24.1 MB, plus one
        # parameter's rows in flight); old 53-59 MB = 1.1-1.2x (the whole model, then its shards)
        assert mem["new"]["grown_mb"] < 0.7 * total_mb, (mem, total_mb)
        assert mem["old"]["grown_mb"] > 0.85 * total_mb, (mem, total_mb)


def test_unsupported_checkpoints_name_why(folders, tmp_path):
    lora = ModelConfig(name_or_path=folders["dense"], lora=LoraConfig(rank=4))
    got = empty_causal_lm(lora)
    assert isinstance(got, Unsupported) and "LoRA" in got.reason
    assert isinstance(empty_causal_lm(lora, lora=False), Built)  # a frozen reference ignores adapters
    model = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(hidden=32, layers=1))
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    got = empty_causal_lm(ModelConfig(name_or_path=str(tmp_path / "bin")))
    assert isinstance(got, Unsupported) and ".bin" in got.reason
    quantized = save_tiny(tmp_path / "fp8", TinyModelSpec(hidden=32, layers=1))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    got = empty_causal_lm(ModelConfig(name_or_path=str(quantized)))
    assert isinstance(got, Unsupported) and "quantized" in got.reason, got
    got = empty_causal_lm(ModelConfig(name_or_path=str(save_tiny_vlm(tmp_path / "vlm"))))
    assert isinstance(got, Unsupported) and "vision-language" in got.reason
    built = empty_value_model(ModelConfig(name_or_path=folders["dense"]), init="zeros")
    assert isinstance(built, Built) and all(p.is_meta for p in built.model.parameters())
    assert all(not b.is_meta for b in built.model.buffers())
