"""RNG capture for exact resume: python, numpy and torch draws repeat after a restore."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from relayrl.training.rng import capture_rng_state, restore_rng_state, seed_everything


def _draws() -> tuple[float, float, float, float]:
    # np.random.standard_normal fills numpy's cached gaussian half the time: the state must carry it too
    return random.random(), float(np.random.rand()), float(np.random.standard_normal()), float(torch.rand(()))


def test_restore_repeats_every_generator_exactly():
    seed_everything(3)
    _draws()  # leave numpy with a cached gaussian (has_gauss = 1)
    state = capture_rng_state()
    first = [_draws() for _ in range(3)]
    _draws()
    restore_rng_state(state)
    assert [_draws() for _ in range(3)] == first


def test_the_state_loads_with_weights_only_torch_load():
    seed_everything(0)
    state = capture_rng_state()
    want = _draws()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # plain types and tensors, nothing pickled
    _draws()
    restore_rng_state(loaded)
    assert _draws() == want


def test_numpy_state_is_stored_as_an_int64_tensor_of_its_keys():
    seed_everything(1)
    name, keys, pos, has_gauss, cached = capture_rng_state()["numpy"]
    ref = np.random.get_state()
    assert name == "MT19937" and keys.dtype == torch.int64 and keys.shape == (624,)
    assert np.array_equal(keys.numpy().astype(np.uint32), ref[1])
    assert (pos, has_gauss, cached) == (ref[2], ref[3], ref[4])


def test_seed_everything_seeds_python_numpy_and_torch():
    seed_everything(7)
    a = _draws()
    seed_everything(7)
    assert _draws() == a
    random.seed(7)
    np.random.seed(7)
    assert (random.random(), float(np.random.rand())) == a[:2]
    assert float(torch.rand((), generator=torch.Generator().manual_seed(7))) == a[3]
