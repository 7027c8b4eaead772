"""The weight group's receiving side without the sender's module (what each vLLM worker of a separate engine
runs): `receive_named` yields every tensor of the sender's layout, in order, lazily; the vLLM worker functions
(relayrl/workers/vllm_receiver.py) over a real gloo group; and the placement of a tensor-parallel
engine (its bundle's GPUs).

vLLM does not run on a CPU: `_VLLMLikeModel` stands in for its model with the contract the worker functions
use (vLLM 0.26: `load_weights(iterable of (HF name, tensor))` copies into its parameters and returns the names
it loaded; an unknown name raises, as its AutoWeightsLoader does), over a real tiny transformers model."""

from __future__ import annotations

import threading
from types import SimpleNamespace

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
            received[r] = list(receive_named(group, layout, "cpu"))
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


class _CountingGroup:
    """A weight group that fills each received tensor with its call number (counts the broadcasts)."""

    backend = "gloo"

    def __init__(self) -> None:
        self.calls = 0

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.calls += 1
        tensor.fill_(self.calls)


def test_receive_named_receives_one_tensor_per_item_asked_for():
    layout = [("a", (2, 3), "torch.float32"), ("b", (4,), "torch.bfloat16"), ("c", (1,), "torch.float32")]
    group = _CountingGroup()
    it = receive_named(group, layout, "cpu")
    assert group.calls == 0
    name, t = next(it)
    assert group.calls == 1 and name == "a" and t.shape == (2, 3) and torch.all(t == 1)
    rest = list(it)
    assert group.calls == 3 and [n for n, _ in rest] == ["b", "c"]
    assert rest[0][1].dtype == torch.bfloat16 and torch.all(rest[1][1] == 3)


class _VLLMLikeModel(torch.nn.Module):
    """See the module doc."""

    def __init__(self, hf: torch.nn.Module, refuse: str = "") -> None:
        super().__init__()
        self.hf, self.refuse, self.loads = hf, refuse, 0

    def load_weights(self, weights):
        self.loads += 1
        params = dict(self.hf.named_parameters())
        done = set()
        for name, tensor in weights:
            if name not in params or name == self.refuse:
                raise ValueError(f"There is no module or parameter named {name!r}")
            params[name].data.copy_(tensor)
            done.add(f"hf.{name}")
        return done


def _worker(model: torch.nn.Module) -> SimpleNamespace:
    return SimpleNamespace(rank=0, model_runner=SimpleNamespace(get_model=lambda: model))


def _send_and_receive(sender, layout, worker, chunk_bytes: int):
    """The sender (rank 0) broadcasts its parameters while the worker (rank 1) joins and receives; returns
    (what receive_weights returned or raised, seconds the sender took)."""
    import time

    from relayrl.workers.vllm_receiver import join_weight_group, receive_weights

    address, port = free_endpoint()
    out: dict = {}

    def receive() -> None:
        try:
            out["rank"] = join_weight_group(worker, address, port, 1, 2, "gloo", 20.0, layout)
            out["result"] = receive_weights(worker, chunk_bytes)
        except BaseException as exc:
            out["result"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    group = WeightGroup(address, port, rank=0, world=2, backend="gloo", timeout_s=20)
    t0 = time.perf_counter()
    with torch.no_grad():
        for p in sender.parameters():
            group.broadcast(p.data)
    seconds = time.perf_counter() - t0
    thread.join(timeout=30)
    return out, seconds


def _models(tiny_model_path):
    from transformers import AutoModelForCausalLM

    sender = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in sender.parameters():
            p.add_(torch.randn_like(p))
    receiver = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return sender, receiver


def test_a_vllm_worker_loads_the_broadcast_in_chunks(tiny_model_path):
    sender, receiver = _models(tiny_model_path)
    model = _VLLMLikeModel(receiver)
    out, _ = _send_and_receive(sender, _layout(sender), _worker(model), chunk_bytes=4096)
    assert out["rank"] == 1 and out["result"] == len(_layout(sender))
    assert model.loads > 3  # several chunks
    assert all(torch.equal(a, b) for a, b in zip(receiver.parameters(), sender.parameters(), strict=True))


def test_a_vllm_worker_refuses_a_layout_that_leaves_parameters_unloaded(tiny_model_path):
    sender, receiver = _models(tiny_model_path)
    layout = _layout(sender)[:-1]  # the sender's layout misses one parameter of the engine's model

    class Partial(torch.nn.Module):  # sends only what the layout lists
        def __init__(self) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList(list(sender.parameters())[:-1])

    out, _ = _send_and_receive(Partial(), layout, _worker(_VLLMLikeModel(receiver)), 1 << 20)
    assert isinstance(out["result"], RuntimeError)
    assert "left 1 of vLLM's parameters unloaded" in str(out["result"])


def test_a_loader_error_midway_still_completes_the_broadcast(tiny_model_path):
    """vLLM's loader raising on the 3rd tensor: the worker takes the rest of the broadcast and raises the
    loader's error; the sender finishes at once (not after its timeout)."""
    sender, receiver = _models(tiny_model_path)
    layout = _layout(sender)
    model = _VLLMLikeModel(receiver, refuse=layout[2][0])
    out, seconds = _send_and_receive(sender, layout, _worker(model), chunk_bytes=1)
    assert isinstance(out["result"], ValueError) and layout[2][0] in str(out["result"])
    assert seconds < 10  # the group's timeout is 20 s
