"""relayrl/training/host_states.py: optimizer states parked in host memory between updates.

On the CPU the parking is exercised through `parks` (which tensors count as "on a device"): states go into one
flat buffer per dtype of exactly their size, as views; unpark gives each back as a tensor of its own; the next
park reuses the same buffers; a layout change rebuilds them; states park did not move stay where they are; an
optimizer parked and unparked every step trains exactly like one never parked. The GPU test (marked `gpu`)
parks real device states into page-locked buffers.
"""

from __future__ import annotations

import pytest
import torch

from relayrl.training.host_states import HostStates


def _stepped(device: str = "cpu", seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt, 1.0)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, g: float) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, g * (i + 1))
    opt.step()


def _states(opt: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {(id(p), k): v for p, s in opt.state.items() for k, v in s.items() if k != "step"}


def test_park_puts_every_state_in_one_exact_buffer_and_unpark_gives_each_back():
    _, opt = _stepped()
    before = {key: v.clone() for key, v in _states(opt).items()}
    parking = HostStates(parks=lambda t: True)
    parking.park(opt)
    parked = _states(opt)
    (flat,) = parking.flat.values()
    assert flat.numel() == sum(v.numel() for v in before.values())  # exactly the states' size, one buffer
    base = flat.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in parked.values())  # views of it
    assert all(torch.equal(parked[key], v) for key, v in before.items())
    parking.unpark(opt)
    back = _states(opt)
    assert all(v.untyped_storage().data_ptr() != base for v in back.values())  # tensors of their own
    assert all(torch.equal(back[key], v) for key, v in before.items())
    parking.park(opt)
    assert parking.flat[torch.float32] is flat  # the same buffer again, no new allocation
    assert all(v is parking.views[key] for key, v in _states(opt).items())


def test_parking_leaves_the_step_counters():
    _, opt = _stepped()
    state = next(iter(opt.state.values()))
    step = state["step"]
    HostStates(parks=lambda t: True).park(opt)
    assert state["step"] is step  # stays where the optimizer keeps it


def test_a_parked_optimizer_trains_exactly_like_one_never_parked():
    model, opt = _stepped()
    twin, twin_opt = _stepped()
    parking = HostStates(parks=lambda t: True)
    for g in (0.5, -2.0, 3.0):
        parking.park(opt)
        parking.unpark(opt)
        _step(model, opt, g)
        _step(twin, twin_opt, g)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_unpark_moves_back_only_what_park_moved():
    _, opt = _stepped()
    chosen = {id(v) for p, s in opt.state.items() if p.dim() == 2 for k, v in s.items() if k != "step"}
    kept = {key: v for key, v in _states(opt).items() if id(v) not in chosen}
    parking = HostStates(parks=lambda t: id(t) in chosen)  # e.g. dist.offload's host shards are not parked
    parking.park(opt)
    parking.unpark(opt)
    assert kept and all(_states(opt)[key] is v for key, v in kept.items())  # untouched objects
    assert parking.parked == {}


def test_a_new_layout_rebuilds_the_buffers_and_states_already_in_host_memory_stay():
    _, opt = _stepped()
    parking = HostStates(parks=lambda t: True)
    parking.park(opt)
    first = parking.flat[torch.float32]
    parking.unpark(opt)
    _, other = _stepped(seed=1)  # another optimizer: other parameters, the same shapes
    parking.park(other)
    assert parking.flat[torch.float32] is not first and len(parking.views) == len(_states(other))
    default = HostStates()  # the default: only states on a device are parked
    states = _states(opt)
    default.park(opt)
    assert default.flat == {} and all(_states(opt)[key] is v for key, v in states.items())


@pytest.mark.gpu
def test_gpu_states_park_page_locked_and_come_back_to_the_gpu():
    model, opt = _stepped("cuda")
    twin, twin_opt = _stepped("cuda")
    parking = HostStates()
    for g in (0.5, -2.0):
        parking.park(opt)
        assert parking.registered and all(v.device.type == "cpu" for v in _states(opt).values())
        assert all(v is parking.views[key] for key, v in _states(opt).items())
        parking.unpark(opt)
        assert all(v.device.type == "cuda" for v in _states(opt).values())
        _step(model, opt, g)
        _step(twin, twin_opt, g)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    parking.release()
    assert parking.registered == [] and parking.flat == {}
