"""The weight group's receiving side without the sender's module (what each vLLM worker of a separate engine
runs): `receive_named` yields every tensor of the sender's layout, in order, lazily; and the placement of a
tensor-parallel engine (its bundle's GPUs)."""

from __future__ import annotations

import threading

import pytest
import torch

from relayrl.config.rl import DistConfig
from relayrl.distributed.launch import rank_gpus
from relayrl.distributed.weight_group import WeightGroup, free_endpoint, receive_named
from relayrl.workers.engine import weight_ranks


def _layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]


def test_receivers_rebuild_the_senders_state_dict_lazily_in_layout_order(tiny_model_path):
    from transformers import AutoModelForCausalLM

    sender = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    with torch.no_grad():  # weights no receiver can have from the folder
        for p in sender.parameters():
            p.add_(torch.randn_like(p))
    layout = _layout(sender)
    address, port = free_endpoint()
    world = weight_ranks(num_engines=1, tp=2)  # the sender + one engine's two tp workers
    assert world == 3
    received: dict[int, list[tuple[str, torch.Tensor]]] = {}
    errors: list[BaseException] = []

    def receiver(r: int) -> None:
        try:
            group = WeightGroup(address, port, rank=r, world=world, backend="gloo", timeout_s=60)
            it = receive_named(group, layout, "cpu")
            first = next(it)  # lazy: one tensor received per item asked for
            received[r] = [first, *it]
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    group = WeightGroup(address, port, rank=0, world=world, backend="gloo", timeout_s=60)
    with torch.no_grad():
        for p in sender.parameters():
            group.broadcast(p.data)
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    want = dict(sender.named_parameters())
    for r in (1, 2):
        names = [n for n, _ in received[r]]
        assert names == [n for n, _, _ in layout]
        for name, tensor in received[r]:
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, want[name].detach())
    rebuilt = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    rebuilt.load_state_dict(dict(received[1]), strict=False)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.parameters(), sender.parameters(), strict=True))


def test_a_tensor_parallel_engine_rank_holds_engine_tp_gpus():
    cfg = DistConfig(mode="ray", num_engines=2, engine_tp=2)
    assert rank_gpus(cfg, "engine") == 2
    assert rank_gpus(cfg, "policy") == 1
    assert weight_ranks(cfg.num_engines, cfg.engine_tp) == 5
    with pytest.raises(ValueError, match="engine_tp"):
        DistConfig(engine_tp=0)
