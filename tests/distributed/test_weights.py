"""EngineWeights: the engine's weights track the trainer's (the weight canary).

- shared: same dtype -> the engine runs on the trainer's own module (nothing to copy).
- copy (mixed precision): after an optimizer step the engine is stale until `refresh`, then equals the
  trainer's weights cast to its dtype exactly (canary 0), with LoRA adapters too; storage addresses of the
  engine's parameters never move (CUDA graphs captured over them stay valid); buffers keep their dtype.
"""

from __future__ import annotations

import torch

from relayrl.distributed.weights import EngineWeights
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer


def _step(model: torch.nn.Module) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(4, 60, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def test_shared_when_dtypes_match():
    model = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0))
    ew = EngineWeights(model, dtype=torch.float32)
    assert ew.shared and ew.model is model and ew.refresh() == 0.0 and ew.max_abs_diff() == 0.0


def test_copy_refresh_canary():
    torch.manual_seed(0)
    model = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0))
    ew = EngineWeights(model, dtype=torch.bfloat16)
    assert not ew.shared and ew.model is not model
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in ew.model.parameters())
    inv = [b for n, b in ew.model.named_buffers() if "inv_freq" in n]
    assert inv and all(b.dtype == torch.float32 for b in inv)  # rotary stays fp32
    assert ew.max_abs_diff() == 0.0
    ptrs = [p.data_ptr() for p in ew.model.parameters()]
    _step(model)
    assert ew.max_abs_diff() > 0  # stale: the canary sees it
    ew.refresh()
    assert ew.max_abs_diff() == 0.0
    for (name, p), q in zip(model.named_parameters(), ew.model.parameters(), strict=True):
        assert torch.equal(q, p.detach().to(torch.bfloat16)), name
    assert [p.data_ptr() for p in ew.model.parameters()] == ptrs


def test_copy_refresh_with_lora():
    from relayrl.config.components import LoraConfig
    from relayrl.models.loading import apply_lora

    torch.manual_seed(0)
    model = apply_lora(build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0)), LoraConfig(rank=4))
    ew = EngineWeights(model, dtype=torch.bfloat16)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)  # so the adapters change the outputs
    _step(model)
    assert ew.max_abs_diff() > 0
    ew.refresh()
    assert ew.max_abs_diff() == 0.0
    lora = [n for n, _ in ew.model.named_parameters() if "lora_" in n]
    assert lora  # the adapters are part of the engine copy
