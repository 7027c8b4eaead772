"""SlotState: the native engine's per-slot device buffers, `assign` (admission) and `advance` (the
sample-record-update after each forward). Logits are made by hand here, so every expected token is known."""

from __future__ import annotations

import pytest
import torch

from relayrl.rollout.native_model import DecoderRunner
from relayrl.rollout.native_state import SlotState
from relayrl.rollout.sampling import sample_tokens, uniform

V = 10  # logits width used below (advance reads only logits' own width)


@pytest.fixture()
def runner(tiny_model):
    return DecoderRunner(tiny_model.eval(), max_len=16)


def _settings(*, temp=0.0, top_p=1.0, top_k=0, seed=1, last=15, pos=0, stops=(-1, -1)):
    return [temp, top_p], [top_k, seed, last, pos, *stops]


def _peaked(*tokens: int) -> torch.Tensor:
    """Logits [len(tokens), V] whose argmax in row i is tokens[i]."""
    logits = torch.linspace(-1.0, 1.0, V).repeat(len(tokens), 1)
    logits[torch.arange(len(tokens)), list(tokens)] = 5.0
    return logits


def test_buffers_have_the_documented_shapes_and_start_done(runner):
    st = SlotState(runner, slots=3, max_stop_ids=2)
    # [layers, slots, kv_heads, max_len, head_dim]: the tiny model has 2 layers, 2 KV heads, 64 / 4 = 16 dims
    assert st.k_cache.shape == st.v_cache.shape == (2, 3, 2, 16, 16)
    assert st.k_cache.dtype == runner.dtype == torch.float32
    assert st.tokens.shape == st.logprobs.shape == st.uniforms.shape == (3, 17)  # max_len + 1 wide
    assert st.stop_ids.shape == (3, 2) and st.stop_ids.eq(-1).all()
    assert st.done.all() and not st.stopped.any()
    assert st.rows.tolist() == [0, 1, 2]
    assert st.snapshot_tensors() == [st.cur_tok, st.pos, st.done, st.stopped]


def test_assign_writes_only_the_admitted_slots(runner):
    st = SlotState(runner, slots=3, max_stop_ids=2)
    st.assign(
        torch.tensor([2, 0]),
        [
            _settings(temp=0.7, top_p=0.9, top_k=5, seed=11, last=9, pos=3, stops=(4, -1)),
            _settings(seed=12, last=6, pos=2, stops=(8, 9)),
        ],
    )
    assert st.temp.tolist() == pytest.approx([0.0, 1.0, 0.7])  # slot 1 keeps its initial settings
    assert st.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert st.top_k.tolist() == [0, 0, 5]
    assert st.last.tolist() == [6, 0, 9] and st.pos.tolist() == [2, 0, 3]
    assert st.stop_ids.tolist() == [[8, 9], [-1, -1], [4, -1]]
    assert st.done.tolist() == [False, True, False] and not st.stopped.any()
    # the uniforms of every position the admitted slots can reach (up to the largest `last`), from their seeds
    span = torch.arange(10)
    assert torch.equal(st.uniforms[2, :10], uniform(torch.tensor([11]), span))
    assert torch.equal(st.uniforms[0, :10], uniform(torch.tensor([12]), span))
    assert not st.uniforms[:, 10:].any() and not st.uniforms[1].any()


def test_greedy_advance_records_the_argmax_and_its_logprob_then_stops_on_a_stop_id(runner):
    st = SlotState(runner, slots=2, max_stop_ids=2)
    st.assign(torch.tensor([0]), [_settings(last=12, pos=2, stops=(7, -1))])
    logits = _peaked(3)
    st.advance(torch.tensor([0]), logits, "greedy")
    assert st.tokens[0, 3] == 3 and st.cur_tok[0] == 3 and st.pos[0] == 3
    assert st.logprobs[0, 3] == pytest.approx(torch.log_softmax(logits[0], -1)[3].item(), rel=1e-6)
    assert not st.done[0]
    st.advance(torch.tensor([0]), _peaked(7), "greedy")  # a stop id: done and stopped, pos on the stop token
    assert st.tokens[0, 4] == 7 and st.pos[0] == 4
    assert st.done[0] and st.stopped[0]
    # a done slot keeps pos and flags; its sample lands at pos + 1, past its end, and in cur_tok
    st.advance(torch.tensor([0]), _peaked(1), "greedy")
    assert st.pos[0] == 4 and st.done[0] and st.stopped[0]
    assert st.tokens[0, 4] == 7 and st.tokens[0, 5] == 1 and st.cur_tok[0] == 1
    assert st.done[1] and st.pos[1] == 0  # the slot never admitted is untouched


def test_the_last_allowed_position_finishes_a_slot_without_stopping_it(runner):
    st = SlotState(runner, slots=1, max_stop_ids=1)
    st.assign(torch.tensor([0]), [_settings(last=4, pos=2, stops=(-1,))])
    st.advance(torch.tensor([0]), _peaked(5), "greedy")
    assert st.pos[0] == 3 and not st.done[0]
    st.advance(torch.tensor([0]), _peaked(6), "greedy")
    assert st.pos[0] == 4 and st.done[0] and not st.stopped[0]  # length, not stop
    assert st.tokens[0, 3:5].tolist() == [5, 6]


def test_sampling_uses_the_uniform_of_the_position_being_sampled(runner):
    st = SlotState(runner, slots=2, max_stop_ids=1)
    st.assign(
        torch.tensor([0, 1]),
        [_settings(temp=1.0, seed=3, pos=4, stops=(-1,)), _settings(temp=0.5, seed=4, pos=6, stops=(-1,))],
    )
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    st.advance(torch.tensor([0, 1]), logits, "sample")
    u = torch.stack([uniform(torch.tensor(3), torch.tensor(5)), uniform(torch.tensor(4), torch.tensor(7))])
    tok, lp = sample_tokens(
        logits, torch.tensor([1.0, 0.5]), torch.ones(2), torch.zeros(2, dtype=torch.long), u, "sample"
    )
    assert st.tokens[0, 5] == tok[0] and st.tokens[1, 7] == tok[1]
    assert torch.equal(st.logprobs[[0, 1], [5, 7]], lp)
    assert st.pos.tolist() == [5, 7]


def test_a_slice_of_slots_advances_like_the_same_slots_by_index(runner):
    """decode passes slice(0, bs) (views); prefill passes slot ids (gathers): the same update."""
    states = [SlotState(runner, slots=3, max_stop_ids=1) for _ in range(2)]
    settings = [_settings(temp=1.0, seed=s, last=8, pos=1, stops=(2,)) for s in range(3)]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    for st, idx in zip(states, (slice(0, 3), torch.arange(3)), strict=True):
        st.assign(torch.arange(3), settings)
        for _ in range(4):
            st.advance(idx, logits, "sample")
    a, b = states
    for name in ("tokens", "logprobs", "cur_tok", "pos", "done", "stopped"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
