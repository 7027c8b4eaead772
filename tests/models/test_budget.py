"""relayrl/models/budget.py and the host-read-free update path (the "Scale efficiency" host-overhead work).

- token_budgets: explicit budgets pass through; 0 (auto) is 4096 / 4096 on a CPU (the numerics of every CPU
  run stay as before); on a CUDA device it is 0.5 x (memory left - pending optimizer bytes) / activation bytes
  per token, rounded down to a multiple of 1024, clamped to [4096, 65536]; the inference budget is 4x it,
  capped at 262144. The memory reading is replaced by a fixed number, so this runs without a GPU.
- bytes_per_token: layers x (32 hidden + 5 intermediate) x compute bytes, hand-computed for the tiny model.
- TokenBudgets resolves once, keeping a fresh optimizer's states (12 bytes per element) out of the memory.
- transformers' packed-row detection (relayrl/models/packed_rows.py) returns None inside our varlen forward
  (no device sync there) and behaves as before outside it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils

from relayrl.models import budget, forward
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.workers.model_ops import TokenBudgets

GIB = 2**30


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(hidden=64, layers=2, intermediate=128))


def test_bytes_per_token_by_hand(model):
    assert budget.bytes_per_token(model, 2) == 2 * (32 * 64 + 5 * 128) * 2  # layers x (...) x bf16 bytes
    assert budget.bytes_per_token(model, 4) == 2 * (32 * 64 + 5 * 128) * 4
    assert budget.bytes_per_token(torch.nn.Linear(2, 2), 2) is None  # no config: the default budget


def test_cpu_auto_is_the_old_default_and_explicit_values_pass_through(model):
    cpu = torch.device("cpu")
    assert budget.token_budgets(model, cpu) == (4096, 4096)
    assert budget.token_budgets(model, cpu, update=512) == (512, 512)
    assert budget.token_budgets(model, cpu, update=512, infer=2048) == (512, 2048)
    with pytest.raises(ValueError, match="token budgets must be >= 0"):
        budget.token_budgets(model, cpu, update=-1)


@pytest.mark.parametrize(
    ("left_gib", "pending_gib", "update", "infer"),
    [
        (40.0, 0.0, 65536, 262144),  # plenty: the caps
        (1.0, 0.0, None, None),  # by hand below
        (1.0, 0.9, 4096, 16384),  # what is left after the optimizer's states is small: the floor
    ],
)
def test_cuda_auto_from_memory_left(model, monkeypatch, left_gib, pending_gib, update, infer):
    monkeypatch.setattr(budget, "_memory_left", lambda device: int(left_gib * GIB))
    got = budget.token_budgets(model, torch.device("cuda"), pending_bytes=int(pending_gib * GIB))
    if update is None:  # 0.5 GiB / 10752 bytes a token = 49932 -> 49152 (multiple of 1024); infer 4x
        per_token = 2 * (32 * 64 + 5 * 128) * 2
        update = int(0.5 * GIB // per_token) // 1024 * 1024
        assert update == 49152
        infer = 4 * update
    assert got == (update, infer)
    # an explicit update budget is kept; the automatic inference budget follows it
    assert budget.token_budgets(model, torch.device("cuda"), update=8192) == (8192, 32768)


def test_token_budgets_resolve_once_with_the_optimizer_states_pending(model, monkeypatch):
    seen: list[int] = []

    def left(device):
        seen.append(1)
        return 40 * GIB

    monkeypatch.setattr(budget, "_memory_left", left)
    opt = torch.optim.AdamW(model.parameters())
    assert budget.pending_optimizer_bytes(opt) == 12 * sum(p.numel() for p in model.parameters())
    b = TokenBudgets(
        model=model, device=torch.device("cuda"), update=0, infer=0, precision="bf16", optimizer=opt
    )
    assert b.get() == b.get() == (65536, 262144) and len(seen) == 1


def test_parked_optimizer_states_count_as_pending(model):
    """Once the states exist they count only while parked away from their parameters' device (they come back
    for the update); states beside their parameters count nothing."""
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert budget.pending_optimizer_bytes(opt) == 0
    for state in opt.state.values():  # parked elsewhere (a GPU run parks them on the CPU)
        for k in ("exp_avg", "exp_avg_sq"):
            state[k] = state[k].to("meta")
    assert budget.pending_optimizer_bytes(opt) == 8 * sum(p.numel() for p in model.parameters())


def test_packed_row_detection_is_skipped_only_inside_a_varlen_forward():
    forward._register()  # installs the skip (once)
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    outside = masking_utils.find_packed_sequence_indices(packed)
    assert outside is not None and outside.tolist() == [[0, 0, 0, 1, 1]]  # transformers' own answer
    token = forward._IN_VARLEN_FORWARD.set(True)
    try:
        assert masking_utils.find_packed_sequence_indices(packed) is None
    finally:
        forward._IN_VARLEN_FORWARD.reset(token)
