"""Device-side state of the native engine: the slot buffers, the per-step update, the CUDA graph cache.

`SlotState` holds every tensor a decode step touches (shapes in native.py's module doc) and `advance`,
the sample-record-update that follows a forward; all static-shape tensor ops, no host sync.
`GraphCache` captures `step_fn(bs, kv_len, mode)` as CUDA graphs in one shared memory pool, keyed by
(bs, kv_len, mode); warm-up runs before capture mutate the slot state, so it is snapshotted and restored
around each capture (warm-up writes to K/V and token buffers land only at positions that the real step
rewrites before anyone reads them).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import cast

import torch

from relayrl.rollout.base import SamplingParams
from relayrl.rollout.exact import ExactRunner
from relayrl.rollout.native_model import DecoderRunner
from relayrl.rollout.native_moe import MoEForward
from relayrl.rollout.sampling import sample_tokens, uniform
from relayrl.rollout.vocab_parallel import VocabParallelHead

log = logging.getLogger(__name__)


class SlotState:
    """Preallocated per-slot device buffers (KV cache, sequences, sampling settings, progress)."""

    def __init__(
        self, runner: DecoderRunner, slots: int, max_stop_ids: int, record_routes: bool = False
    ) -> None:
        dev, long = runner.device, torch.long
        self.max_len = runner.max_len
        self.k_cache = torch.zeros(runner.cache_shape(slots), dtype=runner.dtype, device=dev)
        self.v_cache = torch.zeros(runner.cache_shape(slots), dtype=runner.dtype, device=dev)
        self.tokens = torch.zeros((slots, self.max_len + 1), dtype=long, device=dev)
        self.logprobs = torch.zeros((slots, self.max_len + 1), dtype=torch.float32, device=dev)
        self.uniforms = torch.zeros((slots, self.max_len + 1), dtype=torch.float32, device=dev)
        """The uniform that samples each position: sampling.uniform(seed, position), filled at admission."""
        self.cur_tok = torch.zeros(slots, dtype=long, device=dev)
        self.pos = torch.zeros(slots, dtype=long, device=dev)
        self.last = torch.zeros(slots, dtype=long, device=dev)
        """Position of the last token a slot may sample (max_new_tokens and max_len both counted)."""
        self.done = torch.ones(slots, dtype=torch.bool, device=dev)
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.temp = torch.ones(slots, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(slots, dtype=long, device=dev)
        self.stop_ids = torch.full((slots, max_stop_ids), -1, dtype=long, device=dev)
        self.rows = torch.arange(slots, device=dev)
        self.routes: torch.Tensor | None = None
        """Routing replay: [slots, max_len + 1, MoE layers, k] int16 experts per position (`record_routes`)."""
        if record_routes and runner.moe_layers:
            top_k = cast(MoEForward, runner.mlps[runner.moe_layers[0]]).spec.top_k
            shape = (slots, self.max_len + 1, len(runner.moe_layers), top_k)
            self.routes = torch.full(shape, -1, dtype=torch.int16, device=dev)
        runner.routes = self.routes
        head = getattr(runner.model, "lm_head", None)
        self.sample = head.sample_tokens if isinstance(head, VocabParallelHead) else sample_tokens
        """sampling.sample_tokens (its Triton kernel on CUDA); a tensor-parallel shard's vocab-parallel head
        samples over its logits slice with the other ranks (vocab_parallel.py, its Triton passes on CUDA);
        exact mode keeps the torch ops, whose log_softmax is the trainer's (exact.token_logprobs) bit for bit."""
        if isinstance(runner, ExactRunner):
            self.sample = functools.partial(self.sample, fast=False)

    def snapshot_tensors(self) -> list[torch.Tensor]:
        """The progress tensors a step mutates (besides K/V and token buffers)."""
        return [self.cur_tok, self.pos, self.done, self.stopped]

    def assign(self, idx: torch.Tensor, settings: list[tuple[list[float], list[int]]]) -> None:
        """Start slots `idx` with (floats [temp, top_p], ints [top_k, seed, last, pos, *stop_ids]); pos is
        the position before the first token to sample (the prompt's last)."""
        dev = self.rows.device
        f = torch.tensor([s[0] for s in settings], dtype=torch.float32).to(dev)
        i = torch.tensor([s[1] for s in settings], dtype=torch.long).to(dev)
        self.temp[idx], self.top_p[idx] = f[:, 0], f[:, 1]
        self.top_k[idx], self.last[idx], self.pos[idx] = i[:, 0], i[:, 2], i[:, 3]
        span = max(s[1][2] for s in settings) + 1  # positions these slots can reach
        self.uniforms[idx, :span] = uniform(i[:, 1:2], torch.arange(span, device=dev)[None, :])
        self.stop_ids[idx] = i[:, 4:]
        self.done[idx] = False
        self.stopped[idx] = False

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Move slots `src` into the empty slots `dst` (pairwise, disjoint): K/V of positions [0, length),
        sequence buffers, sampling settings, progress; the sources are left done."""
        s, d = torch.tensor(src, device=self.rows.device), torch.tensor(dst, device=self.rows.device)
        for cache in (self.k_cache, self.v_cache):
            for layer in cache:  # one layer at a time: the gathered copy stays small
                layer[d, :, :length] = layer[s, :, :length]
        per_slot = (self.tokens, self.logprobs, self.uniforms, self.cur_tok, self.pos, self.last, self.done,
                    self.stopped, self.temp, self.top_p, self.top_k, self.stop_ids)  # fmt: skip
        for t in per_slot:
            t[d] = t[s]
        if self.routes is not None:
            self.routes[d, :length] = self.routes[s, :length]
        self.done[s] = True

    def take_routes(self, slot: int, length: int) -> torch.Tensor | None:
        """A finished slot's routes of positions [0, length) on the host, the last (never fed) set to -1."""
        if self.routes is None:
            return None
        out = self.routes[slot, :length].to("cpu", copy=True)
        out[-1] = -1
        return out

    def advance(self, idx: torch.Tensor | slice, logits: torch.Tensor, mode: str) -> None:
        """Sample the token at pos + 1 for slots `idx` (ids, or a slice: views instead of gathers, as decode
        uses) from `logits` [n, V], record it, update flags.

        Slots already done keep pos and flags (cur_tok takes the sample, which nothing reads); their token
        write lands at pos + 1 <= max_len, past their end, inside the max_len + 1 wide buffers.
        """
        rows = self.rows[idx]
        live = ~self.done[idx]
        new_pos = self.pos[idx] + 1
        u = self.uniforms[rows, new_pos]
        tok, lp = self.sample(logits, self.temp[idx], self.top_p[idx], self.top_k[idx], u, mode)
        self.tokens[rows, new_pos] = tok
        self.logprobs[rows, new_pos] = lp
        stop = live & (tok[:, None] == self.stop_ids[idx]).any(-1)
        self.stopped[idx] |= stop
        self.done[idx] |= live & (stop | (new_pos >= self.last[idx]))
        self.pos[idx] += live
        self.cur_tok[idx] = tok


def _param_ptrs(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())


class GraphCache:
    """CUDA graphs of `step_fn(bs, kv_len, mode)`, captured on first `run` (see module doc)."""

    def __init__(
        self,
        step_fn: Callable[[int, int, str], None],
        state_tensors: list[torch.Tensor],
        model: torch.nn.Module,
        warmup: int = 2,
    ) -> None:
        self.step_fn = step_fn
        self.state_tensors = state_tensors
        self.model = model
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph | None] = {}
        self.ptrs = _param_ptrs(model)
        self.captures = 0
        """Graphs captured so far (re-captures included)."""

    def ensure(self, key: tuple[int, int, str]) -> None:
        """Capture the graph for `key` if not yet tried; a failed capture marks the key eager."""
        if key in self.graphs:
            return
        try:
            self.graphs[key] = self._capture(key)
        except Exception:  # e.g. an op that cannot be captured in this torch build: stay correct
            log.warning("CUDA graph capture failed for %s; running that step eagerly", key, exc_info=True)
            self.graphs[key] = None

    def run(self, key: tuple[int, int, str]) -> None:
        """Replay the graph for `key` (capturing it first); a key whose capture failed runs eagerly."""
        self.ensure(key)
        graph = self.graphs[key]
        if graph is None:
            self.step_fn(*key)
        else:
            graph.replay()

    def _capture(self, key: tuple[int, int, str]) -> torch.cuda.CUDAGraph:
        saved = [t.clone() for t in self.state_tensors]
        try:
            return self._capture_with(key)
        finally:
            for t, s in zip(self.state_tensors, saved, strict=True):
                t.copy_(s)

    def _capture_with(self, key: tuple[int, int, str]) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup if self.captures == 0 else 1):  # lazy inits happen in the first
                self.step_fn(*key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.step_fn(*key)
        self.captures += 1
        return graph

    def drop_if_moved(self, model: torch.nn.Module) -> bool:
        """Forget every graph if a parameter's storage moved since capture; True if dropped."""
        ptrs = _param_ptrs(model)
        if ptrs == self.ptrs:
            return False
        self.graphs.clear()
        self.ptrs = ptrs
        return True


def kv_buckets(step: int, max_len: int, doubling: bool) -> tuple[int, ...]:
    """Attention lengths decode runs with: multiples of `step`, always ending at max_len. With `doubling`
    (each is a CUDA graph to capture) only up to 8 steps, then doubling (256, 512, ..., 2048, 4096, 8192, ...
    for step 256)."""
    buckets, b = [], step
    while b < max_len:
        buckets.append(b)
        b = 2 * b if doubling and b >= 8 * step else b + step
    return (*buckets, max_len)


def capture_sizes(max_slots: int, requested: tuple[int, ...] | None) -> tuple[int, ...]:
    """Decode batch sizes to capture: `requested` (default the powers of two below max_slots), capped at and
    always including max_slots, sorted."""
    sizes = requested or tuple(2**i for i in range(max_slots.bit_length()) if 2**i < max_slots)
    return tuple(sorted({min(s, max_slots) for s in sizes} | {max_slots}))


def sampling_mode(params: Iterable[SamplingParams]) -> str:
    """Sampling mode covering every request in `params` (see sampling.py)."""
    params = list(params)
    if all(p.temperature == 0 for p in params):
        return "greedy"
    if any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in params):
        return "truncate"
    return "sample"
