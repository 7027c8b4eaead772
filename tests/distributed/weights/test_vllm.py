"""The vllm transport without vLLM: the functions each vLLM worker of a separate engine runs
(relayrl/distributed/weights/vllm.py) over a real gloo group, and the engine actor's VLLMReceiver (its
workers' ranks, what it runs in them).

vLLM does not run on a CPU: `_VLLMLikeModel` stands in for its model with the contract the worker functions
use (vLLM 0.26: `load_weights(iterable of (HF name, tensor))` copies into its parameters and returns the names
it loaded; an unknown name raises, as its AutoWeightsLoader does), over a real tiny transformers model."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from relayrl.distributed.weights.base import Channel
from relayrl.distributed.weights.broadcast import WeightGroup, free_endpoint
from relayrl.distributed.weights.vllm import VLLMReceiver, join_weight_group, receive_weights
from relayrl.rollout.base import WorkerLoading


def _layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]


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


class _WorkerEngine:
    """Records what a VLLMReceiver runs in the engine's workers."""

    def __init__(self) -> None:
        self.ran: list = []

    def run_in_workers(self, fn, *args):
        self.ran.append((fn, args))
        return [None]

    def load_in_workers(self, fn, *args, version):
        self.ran.append((fn, args, version))


def test_a_vllm_receiver_runs_the_worker_functions_at_its_workers_ranks():
    engine = _WorkerEngine()
    assert isinstance(engine, WorkerLoading)
    receiver = VLLMReceiver(engine, engine_rank=2, tp=4)  # ranks 9..12 of the group
    assert receiver.layout() is None
    layout = [("w", (2,), "torch.float32")]
    receiver.join(Channel(address="h", port=7, world=13, backend="nccl", timeout_s=5.0), layout)
    receiver.receive(3)
    assert engine.ran == [
        (join_weight_group, ("h", 7, 9, 13, "nccl", 5.0, layout)),
        (receive_weights, (), 3),
    ]
