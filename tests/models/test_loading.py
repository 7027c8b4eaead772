"""Model and tokenizer loading: dtype, attention, checkpointing, pad fallback, clear errors, LoRA, merge."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.apps.merge_lora import main as merge_lora_main
from relayrl.config.components import LoraConfig, ModelConfig
from relayrl.models.loading import (
    checkpointing_enabled,
    load_causal_lm,
    load_model_and_tokenizer,
    load_tokenizer,
)
from relayrl.models.merge import merge_lora

IDS = torch.tensor([[5, 6, 7, 8, 9]])


def test_load_local_fp32_matches_saved(tiny_model_path):
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_path)))
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(IDS).logits, ref(IDS).logits, atol=0, rtol=0)
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1


def test_dtype_attention_and_checkpointing(tiny_model_path):
    cfg = ModelConfig(
        name_or_path=str(tiny_model_path),
        dtype="bf16",
        attn_implementation="eager",
        gradient_checkpointing=True,
    )
    model = load_causal_lm(cfg)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert checkpointing_enabled(model) and model.config.use_cache is False
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # every decoder layer
    assert not checkpointing_enabled(load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path))))


def test_pad_token_falls_back_to_eos(tmp_path, tiny_tokenizer):
    import copy

    no_pad = copy.deepcopy(tiny_tokenizer)  # keep the session fixture untouched
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="no pad token"):
        loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "<|im_end|>" and loaded.pad_token_id == 1


def test_clear_errors_for_missing_sources(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"model\.name_or_path is empty"):
        load_causal_lm(ModelConfig())
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_causal_lm(ModelConfig(name_or_path=str(tmp_path / "nope")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="HF_HUB_OFFLINE=1 forbids downloading"):
        load_causal_lm(ModelConfig(name_or_path="someone/not-cached-model-xyz"))


def test_qlora_needs_bitsandbytes_and_cuda(tiny_model_path):
    cfg = ModelConfig(name_or_path=str(tiny_model_path), load_in_4bit=True, lora=LoraConfig(rank=4))
    try:
        import bitsandbytes  # noqa: F401

        have_bnb = True
    except ImportError:
        have_bnb = False
    if have_bnb and torch.cuda.is_available():
        pytest.skip("QLoRA is available here; the error path cannot be exercised")
    with pytest.raises(RuntimeError, match=r"load_in_4bit \(QLoRA\) needs") as err:
        load_causal_lm(cfg)
    if not have_bnb:
        assert "bitsandbytes" in str(err.value)
    if not torch.cuda.is_available():
        assert "CUDA GPU" in str(err.value)


def test_lora_trains_adapters_only_and_merges(tmp_path, tiny_model_path):
    cfg = ModelConfig(
        name_or_path=str(tiny_model_path),
        lora=LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    model = load_causal_lm(cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(("q_proj" in n or "v_proj" in n) for n in trainable)
    # make the adapter non-trivial (B starts at zero), then save, merge and compare outputs
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    expect = model(IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    load_tokenizer(str(tiny_model_path)).save_pretrained(tmp_path / "adapter")
    out = merge_lora(tmp_path / "adapter", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(merged(IDS).logits, expect, atol=1e-5, rtol=1e-5)
    assert (out / "tokenizer_config.json").is_file()
    assert merge_lora_main([str(tmp_path / "adapter"), str(tmp_path / "merged2")]) == 0
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        merge_lora(tmp_path / "merged", tmp_path / "x")
    # the adapter names its base by absolute path, so merging works from any folder; a base that moved is
    # found with --base, and a missing one fails before anything loads, naming the flag
    import json

    named = json.loads((tmp_path / "adapter/adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(named).is_absolute()
    cfg_file = tmp_path / "adapter/adapter_config.json"
    cfg_file.write_text(
        json.dumps({**json.loads(cfg_file.read_text()), "base_model_name_or_path": "./moved/base"})
    )
    with pytest.raises(
        FileNotFoundError,
        match=r"no such folder.*adapter_config\.json.*pass the base model folder with --base",
    ):
        merge_lora(tmp_path / "adapter", tmp_path / "merged3")
    out = merge_lora(tmp_path / "adapter", tmp_path / "merged3", base=str(tiny_model_path))
    torch.testing.assert_close(
        AutoModelForCausalLM.from_pretrained(out)(IDS).logits, expect, atol=1e-5, rtol=1e-5
    )
    assert merge_lora_main([str(tmp_path / "adapter"), str(tmp_path / "m4")]) == 1  # one-line error, exit 1
    # a folder holding another model is refused (it was overwritten file by file); --overwrite replaces it as a
    # whole; the adapter or base folder is never an output
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model-00002-of-00002.safetensors").write_text("stale shard")
    with pytest.raises(ValueError, match=rf"output folder {other} is not empty \(config.json, model-00002"):
        merge_lora(tmp_path / "adapter", other, base=str(tiny_model_path))
    assert merge_lora_main([str(tmp_path / "adapter"), str(other), "--base", str(tiny_model_path)]) == 1
    assert (other / "config.json").read_text() == "{}"
    merge_lora(tmp_path / "adapter", other, base=str(tiny_model_path), overwrite=True)
    assert not (other / "model-00002-of-00002.safetensors").exists()
    torch.testing.assert_close(
        AutoModelForCausalLM.from_pretrained(other)(IDS).logits, expect, atol=1e-5, rtol=1e-5
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    for into in (tmp_path / "adapter", tiny_model_path):
        with pytest.raises(ValueError, match=r"is the (adapter|base model) folder"):
            merge_lora(tmp_path / "adapter", into, base=str(tiny_model_path), overwrite=True)


def test_lora_all_linear(tiny_model_path):
    model = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path), lora=LoraConfig(rank=2)))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_resolve_device_is_the_one_device_rule(monkeypatch):
    from relayrl.models.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("") == resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(
        RuntimeError, match=r"serve\.device=cuda but no CUDA device is available; use --serve\.device"
    ):
        resolve_device("cuda", "serve.device")


def test_load_pretrained_names_the_field_and_places_the_model(tmp_path, tiny_model_path):
    from relayrl.models.loading import load_pretrained

    model = load_pretrained(AutoModelForCausalLM, str(tiny_model_path), device="cpu")
    assert next(model.parameters()).device == torch.device("cpu")
    with pytest.raises(FileNotFoundError, match="reward model="):
        load_pretrained(AutoModelForCausalLM, str(tmp_path / "nope"), what="reward model")
