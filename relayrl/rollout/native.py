"""`native` engine (the default): continuous batching over a preallocated KV cache, on the policy's own
live weights, sampling on the device, CUDA graphs for decode.

Design
------
Slots. The engine owns `max_slots` sequence slots. Per slot, on the device: the KV cache
[layers, slots, kv_heads, max_len, head_dim] (native_model.DecoderRunner), the sequence buffers
tokens/logprobs [slots, max_len + 1], the uniforms that sample each position [slots, max_len + 1]
(filled at admission from the slot's seed, sampling.uniform), and small state vectors cur_tok, pos
(position of cur_tok), last (position of the last token allowed: max_new_tokens and max_len), done,
stopped, plus the sampling settings temp, top_p, top_k and stop_ids [slots, max_stop_ids] (-1 padded).
The host mirrors only what it can compute without reading the device: which slots are taken, each slot's
admission step (so upper bounds of pos).

A round (one call of `_step` by the driver, driver.py: a thread on CUDA, the callers' event loops on CPU):
  1. admit: pop waiting requests while n free slots exist (lowest slot ids first, so decode batches stay
     short); right-pad their prompts into prefill batches of <= max_prefill_tokens padded tokens; ONE
     prefill per prompt writes its K/V into all n slots of the request; each slot samples its first token
     from the shared last-position logits with its own seed. With the prefix cache (slots.py), an n=1
     request whose prompt starts with a parked slot's sequence takes that slot, and a step that admits any
     such request prefills all of its requests' uncached suffixes in ONE call (prefix_cache.py).
  2. decode k steps without looking at the device: k = min(sync_every, fewest steps until some slot must
     hit a length limit). A step runs slots [0, bs) with bs the smallest captured batch size covering the
     highest taken slot (after `_compact` moved live samples into the lowest empty slots, when that
     shrinks bs) and attends over kv_len = the smallest length bucket covering the longest
     sequence (buckets of 256 with CUDA graphs, one graph each; of 16 eager, so CPU attention cost
     follows the real lengths). Finished or free slots inside [0, bs) keep running harmlessly (pos and
     flags are frozen by `done`; their writes land past their ends).
  3. sync once: read done/stopped/pos, copy finished rows to the host, resolve futures, free slots.
So the host syncs once per k tokens (not per token); stop tokens are detected on the device.

Weight versions (partial rollout): `load_weights` runs between rounds. Running requests keep their slots
and K/V (computed by the old weights) and continue under the new weights; each request notes (tokens
produced per slot, new version) so every completion carries per-token versions (Completion.versions).

Step (`_decode_step(bs, kv_len, mode)`): forward -> `sampling.sample_tokens` -> record token and
log-prob -> update done/stopped/pos in place, all with static shapes. On CUDA it is captured
as one CUDA graph per (bs, kv_len bucket, sampling mode) at start-up (mode "sample") or on first use
(other modes); replay costs one launch. `load_weights(None)` re-captures if a parameter's storage moved
(graphs hold raw pointers); in-place updates (optimizer steps, `load_weights(named)`) need nothing.

Guarantees
----------
- Greedy (temperature 0) = argmax of the model's logits at every step.
- Seeded sampling: a sample depends only on (seed, sample index, prompt, params) and its logits, not
  on the batch it ran in or a generator's state (counter-based uniforms, sampling.py). Bitwise equal
  logits across different batch compositions are exact on CPU; on GPU a batched GEMM may round
  differently at different batch sizes, so reproducibility there is for the same workload. With exact=True
  (exact.py) samples are bitwise batch-invariant on every device, prefix cache on or off (prefix_cache.py).
- Unseeded requests get seeds from the engine's `seed` (None: fresh randomness per engine).
- Log-probs: log_softmax(logits / T) of the sampled token, before top-p/top-k; T = 1 when greedy.
- Length: at most max_new_tokens per sample and max_seq_len tokens per sequence (prompt included);
  a prompt of >= max_seq_len tokens returns empty LENGTH completions without running the model.
"""

from __future__ import annotations

import bisect
import contextlib
import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from relayrl.rollout.base import (
    Completion,
    EngineCapabilities,
    EngineSettings,
    FinishReason,
    GenerationRequest,
    SamplingParams,
)
from relayrl.rollout.driver import Pending, ThreadedEngine, default_driver, load_named_tensors
from relayrl.rollout.fp8 import build_runner
from relayrl.rollout.hf import default_eos_ids
from relayrl.rollout.native_state import GraphCache, SlotState, capture_sizes, kv_buckets, sampling_mode
from relayrl.rollout.prefix_cache import Suffix, default_prefix_cache, suffix_prefill
from relayrl.rollout.sampling import mix_seed
from relayrl.rollout.slots import SlotPool


@dataclass(eq=False, slots=True)
class _Running:
    """A request holding slots."""

    pending: Pending
    slots: list[int]
    prompt_len: int
    admit_step: int
    out: dict[int, Completion] = field(default_factory=dict)
    """Finished samples by sample index (their entry in `slots` is then -1: the slot is no longer theirs)."""
    marks: list[tuple[int, int]] = field(default_factory=list)
    """(tokens produced per slot when the version changed, the new version), in order: token j of a slot
    was produced by the version of the last mark with count <= j."""

    def versions(self, length: int) -> list[int]:
        """Per-token weight versions of a completion of `length` tokens."""
        out: list[int] = []
        for i, (_, version) in enumerate(self.marks):
            end = self.marks[i + 1][0] if i + 1 < len(self.marks) else length
            out.extend([version] * max(0, min(end, length) - len(out)))
        return out


class NativeEngine(ThreadedEngine):
    """The built-in continuous-batching engine (see module doc)."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities(fixed_slots=True, tensor_parallel=True)

    @classmethod
    def options(cls, settings: EngineSettings) -> dict[str, Any]:
        """max_seq_len, max_slots (= settings.max_seqs), prefix_cache, exact, fused_kernels, record_routes, each
        when set."""
        opts = super().options(settings)
        for key, value in (("max_slots", settings.max_seqs), ("prefix_cache", settings.prefix_cache)):
            if value is not None:
                opts[key] = value
        if settings.exact or not settings.fused_kernels:  # only what differs from the defaults (None: auto)
            opts.update(exact=settings.exact, fused_kernels=None if settings.fused_kernels else False)
        opts.update({"record_routes": True} if settings.record_routes else {})
        return opts

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        max_slots: int = 64,
        max_seq_len: int | None = None,
        max_prefill_tokens: int = 8192,
        sync_every: int = 16,
        cuda_graphs: bool | None = None,
        graph_batch_sizes: tuple[int, ...] | None = None,
        kv_bucket: int | None = None,
        max_stop_ids: int = 8,
        eos_token_id: int | list[int] | None = None,
        seed: int | None = None,
        decode_attention: str = "auto",
        driver: str | None = None,
        prefix_cache: bool | None = None,
        min_prefix_tokens: int = 8,
        compact: bool = True,
        exact: bool = False,
        fused_kernels: bool | None = None,
        record_routes: bool = False,
        quantization: str = "none",
    ) -> None:
        """`max_slots`: concurrent sequences (KV cache rows); `max_seq_len`: total length limit and cache
        length (default min(max_position_embeddings, 4096)); `max_prefill_tokens`: padded tokens per
        prefill batch; `sync_every`: decode steps between host syncs; `cuda_graphs`: capture decode
        (default: on CUDA); `graph_batch_sizes`: captured batch sizes (default powers of two and
        max_slots); `kv_bucket`: attention length granularity (default 256 with CUDA graphs, one graph per
        bucket; 16 eager, where attention cost follows the longest sequence); `eos_token_id`: stop ids for
        every request (default the tokenizer's EOS; [] for none); `seed`: source of unseeded requests'
        seeds (None: fresh); `decode_attention`: "sdpa" | "math" | "auto" (sdpa on CUDA); `driver`: who runs
        the rounds, "thread" | "loop" (default: thread on CUDA, the callers' event loops on CPU; driver.py);
        `prefix_cache`: keep a finished sample's K/V in its slot and reuse it for a later n=1 request that
        starts with at least `min_prefix_tokens` of the same tokens (the next turn of a multi-turn episode);
        None: on for a CPU model, on CUDA as prefix_cache.PREFIX_CACHE_ON_CUDA says (on since an H200 run of
        bench/multiturn.py showed the batched suffix prefill pays: 1.06-1.56x); `compact`: move live samples into the
        lowest slots when that shrinks the decode batch (slots of finished samples stop being computed);
        `exact`: exact.py's batch-invariant forward (log-probs = the trainer's); `quantization` "fp8": fp8.py;
        `fused_kernels`: decode through rollout/kernels.py's Triton kernels (None: on CUDA when triton imports);
        `record_routes`: a mixture-of-experts model's experts per token in Completion.routes (routing replay)."""
        super().__init__(name="native", driver=driver or default_driver(next(model.parameters()).device))
        t0 = time.perf_counter()
        self.model, cfg = model, model.config
        self.max_seq_len = int(max_seq_len or min(getattr(cfg, "max_position_embeddings", 4096), 4096))
        self.max_slots, self.max_prefill_tokens = max_slots, max_prefill_tokens
        self.sync_every = max(1, sync_every)
        self.eos_ids = default_eos_ids(model, tokenizer, eos_token_id)
        self.max_stop_ids = max(max_stop_ids, len(self.eos_ids))
        self.runner = build_runner(
            model, self.max_seq_len, decode_attention, exact, quantization, fused_kernels)  # fmt: skip
        self.device = self.runner.device
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("NativeEngine(cuda_graphs=True) needs the model on a CUDA device")
        self.graph_batch_sizes = capture_sizes(max_slots, graph_batch_sizes)
        self.kv_buckets = kv_buckets(
            kv_bucket or (256 if self.cuda_graphs else 16), self.max_seq_len, self.cuda_graphs
        )
        self._rng = random.Random(seed)
        self._waiting: deque[Pending] = deque()
        self._running: set[_Running] = set()
        self._slot_owner: dict[int, _Running] = {}
        cache = default_prefix_cache(self.device) if prefix_cache is None else prefix_cache
        self.pool = SlotPool(max_slots, prefix_cache=cache, min_prefix_tokens=min_prefix_tokens)
        """Free slots and the prefix cache (slots.py)."""
        self.cached_tokens = 0
        """Prompt tokens whose K/V came from the prefix cache instead of a prefill."""
        self.state: SlotState | None = None
        self.graphs: GraphCache | None = None
        self.prefill_count = self.prefill_tokens = self.decode_steps = self.prefill_batches = 0
        """Counters: prompts prefilled (a request with n samples counts once), prompt tokens prefilled
        (unpadded), batched decode steps run, prefill forward calls."""
        self.compact, self.record_routes = compact, record_routes
        self.compactions = 0
        """Times live slots were moved down to shrink the decode batch (`_compact`)."""
        self._reacquire()
        self.startup_s = time.perf_counter() - t0
        """Seconds spent in the constructor (cache allocation and CUDA graph capture)."""

    # ---- memory / weights -----------------------------------------------------------------------------
    def _reacquire(self) -> None:
        if self.state is not None:
            return
        with torch.no_grad():
            self.state = SlotState(self.runner, self.max_slots, self.max_stop_ids, self.record_routes)
            if self.cuda_graphs:
                self.graphs = GraphCache(self._decode_step, self.state.snapshot_tensors(), self.model)
                with torch.cuda.device(self.device):
                    for bs in reversed(self.graph_batch_sizes):
                        for kv_len in reversed(self.kv_buckets):
                            self.graphs.ensure((bs, kv_len, "sample"))
                    torch.cuda.synchronize()

    def _release(self) -> None:
        self.pool.drop_parked()
        self.graphs = None
        self.state = self.runner.routes = None  # the runner holds the routes buffer too
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        self.pool.drop_parked()  # their K/V came from the old weights
        if named_tensors is not None:
            load_named_tensors(self.model, named_tensors)
        self.runner.refresh_weights()  # fp8: re-quantise (rollout/fp8.py); else nothing
        if self.graphs is not None:
            self.graphs.drop_if_moved(self.model)

    def _version_changed(self) -> None:
        # between rounds: every slot of a running request has produced 1 (prefill) + one per decode step
        for run in self._running:
            run.marks.append((1 + self.decode_steps - run.admit_step, self.version))

    # ---- protocol hooks -------------------------------------------------------------------------------
    def _validate(self, request: GenerationRequest) -> None:
        super()._validate(request)
        p = request.params
        rid = request.request_id
        if p.n > self.max_slots:
            raise ValueError(
                f"request {rid!r}: n={p.n} exceeds the engine's max_slots={self.max_slots}; raise max_slots"
            )
        stops = set(self.eos_ids) | set(p.stop_token_ids)
        if len(stops) > self.max_stop_ids:
            raise ValueError(
                f"request {rid!r}: {len(stops)} stop ids > max_stop_ids={self.max_stop_ids}; raise it"
            )
        bad = [t for t in request.prompt_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(
                f"request {rid!r}: prompt ids {bad[:5]} outside the vocabulary [0, {self.runner.vocab_size})"
            )

    def _busy(self) -> bool:
        return bool(self._waiting or self._running)

    def _abort_inflight(self) -> None:
        for p in self._waiting:
            p.abort()
        self._waiting.clear()
        for run in list(self._running):
            run.pending.abort()
            self._free_slots(run)

    def _fail_inflight(self, exc: BaseException) -> None:
        for p in self._waiting:
            p.fail(exc)
        self._waiting.clear()
        for run in list(self._running):
            run.pending.fail(exc)
            self._free_slots(run)

    def _step(self, new: list[Pending]) -> None:
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self._round(new)

    def _round(self, new: list[Pending]) -> None:
        self._waiting.extend(new)
        for run in [r for r in self._running if r.pending.cancelled]:
            self._free_slots(run)
        self._admit()
        if not self._running:
            return
        if self.compact:
            self._compact()
        # batch size, sampling mode and longest sequence are fixed for the round (host-side bounds)
        bs = next(b for b in self.graph_batch_sizes if b > max(self._slot_owner))
        mode = sampling_mode(run.pending.request.params for run in self._running)
        longest = max(run.prompt_len + self.decode_steps - run.admit_step for run in self._running)
        for _ in range(self._steps_before_sync()):
            longest = min(longest + 1, self.max_seq_len)  # attend to positions [0, pos] of the longest
            self._decode_once(bs, longest, mode)
        self._retire()

    # ---- admission / prefill --------------------------------------------------------------------------
    def _admit(self) -> None:
        while self._waiting:
            admitted: list[tuple[_Running, int]] = []  # (run, cached prefix length; 0: none)
            width = 0
            while self._waiting and self.pool.available() >= self._waiting[0].request.params.n:
                p = self._waiting[0]
                plen, n = len(p.request.prompt_ids), p.request.params.n
                if p.cancelled or plen >= self.max_seq_len:
                    self._waiting.popleft()
                    p.finish([Completion(token_ids=[], logprobs=[], finish_reason=FinishReason.LENGTH)] * n)
                    continue
                hit = self.pool.match(p.request.prompt_ids) if n == 1 else None
                m = 0 if hit is None else hit[1]
                if self._over_budget(len(admitted), max(width, plen - m)):
                    break
                self._waiting.popleft()
                if hit is not None:
                    self.pool.claim(hit[0])
                slots = [hit[0]] if hit is not None else [self.pool.take() for _ in range(n)]
                admitted.append((self._start(p, slots), m))
                width = max(width, plen - m)
            if not admitted:
                return
            if any(m for _, m in admitted):  # one call for the step: cached suffixes and fresh prompts
                self._prefill_suffixes(admitted)
            else:
                self._prefill([run for run, _ in admitted], width)

    def _start(self, pending: Pending, slots: list[int]) -> _Running:
        """A request admitted onto `slots` now, under the current weight version."""
        return _Running(
            pending=pending,
            slots=slots,
            prompt_len=len(pending.request.prompt_ids),
            admit_step=self.decode_steps,
            marks=[(0, self.version)],
        )

    def _over_budget(self, rows: int, width: int) -> bool:
        """One more row would push a non-empty prefill batch past max_prefill_tokens padded tokens."""
        return rows > 0 and (rows + 1) * width > self.max_prefill_tokens

    def _register(self, batch: list[_Running]) -> tuple[torch.Tensor, torch.Tensor]:
        """Make `batch` running, set its slots' sampling state; returns (slot ids, each slot's batch row)."""
        st = self.state
        assert st is not None, "the engine holds no slot state (asleep or closed)"
        slot_rows, settings = [], []
        for b, run in enumerate(batch):
            for j, s in enumerate(run.slots):
                slot_rows.append((s, b))
                settings.append(self._slot_settings(run.pending.request.params, j, run.prompt_len))
                self._slot_owner[s] = run
            self._running.add(run)
        slot_idx = torch.tensor([s for s, _ in slot_rows], device=self.device)
        st.assign(slot_idx, settings)
        return slot_idx, torch.tensor([b for _, b in slot_rows], device=self.device)

    def _prefill(self, batch: list[_Running], width: int) -> None:
        """Fresh prompts, right-padded to `width`: one causal prefill, K/V shared by each prompt's n slots."""
        st = self.state
        assert st is not None, "the engine holds no slot state (asleep or closed)"
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for b, run in enumerate(batch):
            ids[b, : run.prompt_len] = torch.tensor(run.pending.request.prompt_ids)
        slot_idx, row_idx = self._register(batch)
        last = torch.tensor([run.prompt_len - 1 for run in batch], device=self.device)
        logits = self.runner.prefill(ids.to(self.device), last, st.k_cache, st.v_cache, slot_idx, row_idx)
        st.advance(slot_idx, logits[row_idx], sampling_mode(r.pending.request.params for r in batch))
        self._count(batch, 0)

    def _prefill_suffixes(self, admitted: list[tuple[_Running, int]]) -> None:
        """The step's requests, some on slots holding a prefix of their prompt (m > 0 tokens): one forward
        over every uncached suffix (prefix_cache.py)."""
        st = self.state
        assert st is not None, "the engine holds no slot state (asleep or closed)"
        batch = [run for run, _ in admitted]
        suffixes = [Suffix(run.pending.request.prompt_ids[m:], m, run.slots) for run, m in admitted]
        slot_idx, row_idx = self._register(batch)
        logits = suffix_prefill(self.runner, st.k_cache, st.v_cache, suffixes)
        st.advance(slot_idx, logits[row_idx], sampling_mode(r.pending.request.params for r in batch))
        self._count(batch, sum(m for _, m in admitted))

    def _count(self, batch: list[_Running], cached: int) -> None:
        self.prefill_count += len(batch)
        self.prefill_tokens += sum(run.prompt_len for run in batch) - cached
        self.cached_tokens += cached
        self.prefill_batches += 1

    def _slot_settings(
        self, params: SamplingParams, index: int, prompt_len: int
    ) -> tuple[list[float], list[int]]:
        """Per-slot (floats, ints) rows for SlotState.assign."""
        seed = self._rng.getrandbits(31) if params.seed is None else mix_seed(params.seed, index)
        stops = sorted(set(self.eos_ids) | set(params.stop_token_ids))
        stops += [-1] * (self.max_stop_ids - len(stops))
        # pos starts at prompt_len - 1 so that advance() places the first sampled token at prompt_len
        last = min(prompt_len + params.max_new_tokens, self.max_seq_len) - 1
        return [params.temperature, params.top_p], [max(params.top_k, 0), seed, last, prompt_len - 1, *stops]

    # ---- decode ---------------------------------------------------------------------------------------
    def _steps_before_sync(self) -> int:
        """Decode steps that surely finish no slot by length before the last one (>= 1)."""
        steps = self.sync_every
        for run in self._running:
            p = run.pending.request.params
            done_steps = self.decode_steps - run.admit_step  # decode tokens produced so far
            gen = 1 + done_steps
            pos = run.prompt_len + done_steps
            steps = min(steps, p.max_new_tokens - gen, self.max_seq_len - 1 - pos)
        return max(1, steps)

    def _decode_once(self, bs: int, kv_needed: int, mode: str) -> None:
        # eager runs pad like the graphs (finer buckets by default), so CPU tests cover the padded shapes
        kv_len = self.kv_buckets[bisect.bisect_left(self.kv_buckets, kv_needed)]
        if self.graphs is not None:
            self.graphs.run((bs, kv_len, mode))
        else:
            self._decode_step(bs, kv_len, mode)
        self.decode_steps += 1

    def _decode_step(self, bs: int, kv_len: int, mode: str) -> None:
        st = self.state
        assert st is not None, "the engine holds no slot state (asleep or closed)"
        b = slice(0, bs)
        logits = self.runner.decode(st.cur_tok[b], st.pos[b], st.k_cache, st.v_cache, kv_len, st.rows[b])
        st.advance(b, logits, mode)

    # ---- retire ---------------------------------------------------------------------------------------
    def _retire(self) -> None:
        st = self.state
        assert st is not None, "the engine holds no slot state (asleep or closed)"
        taken = sorted(self._slot_owner)
        idx = torch.tensor(taken, device=self.device)
        flags = torch.stack([st.done[idx].long(), st.stopped[idx].long(), st.pos[idx]]).tolist()
        finished = [(s, stopped, pos) for s, done, stopped, pos in zip(taken, *flags, strict=True) if done]
        if not finished:
            return
        # one copy of the rows' generated span (a done slot's pos is its last token's: tokens prompt_len..pos)
        fidx = torch.tensor([s for s, _, _ in finished], device=self.device)
        lo = min(self._slot_owner[s].prompt_len for s, _, _ in finished)
        hi = max(pos for _, _, pos in finished) + 1
        toks, lps = st.tokens[fidx, lo:hi].tolist(), st.logprobs[fidx, lo:hi].tolist()
        for i, (s, stopped, pos) in enumerate(finished):
            run = self._slot_owner.pop(s)
            a, b, j = run.prompt_len - lo, pos + 1 - lo, run.slots.index(s)
            run.slots[j] = -1
            run.out[j] = Completion(
                token_ids=toks[i][a:b],
                logprobs=lps[i][a:b],
                finish_reason=FinishReason.STOP if stopped else FinishReason.LENGTH,
                versions=run.versions(b - a),
                routes=st.take_routes(s, pos + 1),
            )
            # the slot holds K/V of prompt + completion except its last token (sampled, never fed back);
            # a sample that ran across a weight change holds mixed K/V: not kept
            if len(run.marks) > 1 or not self.pool.enabled:
                self.pool.release(s)
            else:
                self.pool.park(s, list(run.pending.request.prompt_ids) + toks[i][a : b - 1])
            if len(run.out) == len(run.slots):
                self._running.discard(run)
                run.pending.finish([run.out[j2] for j2 in range(len(run.slots))])

    def _compact(self) -> None:
        """When the taken slots would fit a smaller decode batch than the highest one needs (samples finished
        at different steps), move the highest into the lowest empty slots (K/V, sequences, settings, seeds'
        uniforms: samples are unchanged), so decode runs over live slots, not finished ones."""
        taken = sorted(self._slot_owner)
        need = next(b for b in self.graph_batch_sizes if b >= len(taken))
        if taken[-1] < need:
            return
        movers = [s for s in taken if s >= need]
        targets = sorted(s for s in self.pool.free if s < need)[: len(movers)]
        if len(targets) < len(movers):  # parked slots hold the room
            return
        runs = [self._slot_owner.pop(s) for s in movers]
        length = max(r.prompt_len + self.decode_steps - r.admit_step for r in runs) + 1
        assert self.state is not None, "the engine holds no slot state (asleep or closed)"
        self.state.move(movers, targets, min(length, self.max_seq_len))
        for src, dst, run in zip(movers, targets, runs, strict=True):
            self._slot_owner[dst] = run
            run.slots[run.slots.index(src)] = dst
        self.pool.swap_free(targets, movers)
        self.compactions += 1

    def _free_slots(self, run: _Running) -> None:
        """Drop a request's remaining slots (cancel / abort) and mark them done on the device."""
        left = [s for s in run.slots if self._slot_owner.get(s) is run]
        if left and self.state is not None:
            self.state.done[torch.tensor(left, device=self.device)] = True
        for s in left:
            del self._slot_owner[s]
            self.pool.release(s)
        self._running.discard(run)
