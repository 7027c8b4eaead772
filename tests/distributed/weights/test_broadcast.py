"""The broadcast transport over real gloo groups (threads as ranks): the receiving side without the sender's
module (`receive_named` yields every tensor of the sender's layout, in order, lazily); the sender and a
separate engine's module receiver (BroadcastSender -> ModuleReceiver: the engine's weights equal the sender's
after one receive, taken while its rounds are paused, with the version); connect_engines refusing mismatched
layouts; and the placement of a tensor-parallel engine (its bundle's GPUs, `weight_ranks`)."""

from __future__ import annotations

import threading

import pytest
import torch

from relayrl.config.dist import DistConfig
from relayrl.distributed.launch.placement import rank_gpus
from relayrl.distributed.weights.base import Channel, module_layout
from relayrl.distributed.weights.broadcast import (
    BroadcastSender,
    ModuleReceiver,
    WeightGroup,
    connect_engines,
    free_endpoint,
    receive_named,
    weight_ranks,
)


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


class _PauseRecordingEngine:
    """Stands in for a rollout engine: records whether each load_weights ran inside `paused()`, and the
    receiver's module weights at that moment."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.inside, self.loads = model, False, []

    def paused(self):
        import contextlib

        @contextlib.contextmanager
        def block():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

        return block()

    def load_weights(self, named_tensors=None, *, version=None):
        snapshot = [p.detach().clone() for p in self.model.parameters()]
        self.loads.append((named_tensors, version, self.inside, snapshot))


def test_a_module_receiver_takes_the_senders_weights_while_its_engine_is_paused(tiny_model_path):
    from transformers import AutoModelForCausalLM

    sender_model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in sender_model.parameters():
            p.add_(torch.randn_like(p))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    engine = _PauseRecordingEngine(model)
    receiver = ModuleReceiver(engine, model, engine_rank=1)  # type: ignore[arg-type]
    assert receiver.rank == 2 and receiver.layout() == module_layout(sender_model)
    address, port = free_endpoint()
    channel = Channel(address=address, port=port, world=3, backend="gloo", timeout_s=30)
    errors: list[BaseException] = []

    def idle_rank() -> None:  # engine 0 of the group: takes the broadcast into a throwaway copy
        try:
            other = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
            r = ModuleReceiver(_PauseRecordingEngine(other), other, engine_rank=0)  # type: ignore[arg-type]
            r.join(channel, r.layout())
            r.receive(5)
        except BaseException as exc:
            errors.append(exc)

    def engine_rank() -> None:
        try:
            receiver.join(channel, receiver.layout())
            receiver.receive(5)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=idle_rank), threading.Thread(target=engine_rank)]
    for t in threads:
        t.start()
    sender = BroadcastSender()
    sender.join(channel)
    sender.send(sender_model)
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    [(named, version, inside, snapshot)] = engine.loads
    assert named is None and version == 5 and inside  # in place, as version 5, rounds paused
    assert all(torch.equal(a, b) for a, b in zip(snapshot, sender_model.parameters(), strict=True))


class _Done:
    def __init__(self, value) -> None:
        self.value = value

    def result(self):
        return self.value


class _Handle:
    """A role handle that answers `call`s from a table and records every call and submit (by method name)."""

    def __init__(self, answers: dict) -> None:
        self.answers, self.calls = answers, []

    def call(self, method, *args):
        self.calls.append((method.__name__, args))
        return self.answers.get(method.__name__)

    def submit(self, method, *args):
        return _Done(self.call(method, *args))


class _Launcher:
    use_gpus = False


def test_connect_engines_joins_every_rank_then_sends_version_0():
    layout = [("w", (2, 3), "torch.float32")]
    policy = _Handle({"weight_layout": layout, "weight_endpoint": ("10.0.0.1", 1234), "sync": {"t": 1.0}})
    engines = _Handle({"weight_layout": layout})
    connect_engines(policy, engines, _Launcher(), n=2, timeout_s=9.0, tp=2)  # type: ignore[arg-type]
    channel = Channel(address="10.0.0.1", port=1234, world=5, backend="gloo", timeout_s=9.0)
    assert policy.calls == [
        ("weight_layout", ()),
        ("weight_endpoint", ()),
        ("join_weights", (channel,)),
        ("sync", (0,)),
    ]
    assert engines.calls == [
        ("weight_layout", ()),
        ("join_weights", (channel, layout)),
        ("receive_weights", (0,)),
    ]


def test_connect_engines_refuses_a_layout_that_differs_before_anyone_joins():
    policy = _Handle({"weight_layout": [("w", (2, 3), "torch.float32")], "weight_endpoint": ("h", 1)})
    engines = _Handle({"weight_layout": [("w", (2, 3), "torch.bfloat16")]})
    with pytest.raises(RuntimeError, match=r"differ from the policy's replica .*torch.bfloat16"):
        connect_engines(policy, engines, _Launcher(), n=1, timeout_s=9.0)  # type: ignore[arg-type]
    assert [m for m, _ in policy.calls] == ["weight_layout"]  # no endpoint, no join
