"""The tensor-parallel native engine: one model spread over a process group of TP ranks (Megatron's split).

Sharding (`shard_model`): every rank holds its own copy of its slice of the weights (an engine shard cannot
read a trainer's modules in place):

    q_proj, k_proj, v_proj     column-parallel: output rows split by heads (H / TP query heads, Hkv / TP KV
                               heads per rank; the GQA group of a query head stays on its rank), biases too
    o_proj                     row-parallel: input columns split by the same heads; ONE all-reduce of its
                               output (`RowParallelLinear`), bias added once after it
    gate_proj, up_proj         column-parallel: intermediate rows split
    down_proj                  row-parallel: input columns split; ONE all-reduce
    lm_head                    vocab-parallel: rows split as torch.tensor_split cuts the vocabulary
                               (rollout/vocab_parallel.py: each rank computes its logits slice and the ranks
                               sample together with two [B, 2]-sized all-reduces, no logits gather); tied
                               to the embedding: a view of the replicated embedding's rows
    embed_tokens, norms, rotary, q_norm / k_norm (Qwen3, per head_dim)   replicated

So a decoder block costs two all-reduces ([tokens, hidden] each), and the KV cache of a rank holds its Hkv / TP
heads. On GPUs the engine sums them through PyTorch's symmetric memory (one-shot / two-shot kernels over
NVLink peer-to-peer, CUDA-graph captured; tp_allreduce.py) where that works, else, and for tensors larger than
its buffer, through NCCL (`TPNativeEngine(allreduce=...)`, env RELAYRL_TP_ALLREDUCE). The shard is the HF
model itself with smaller Linears, its config saying H / TP and Hkv / TP heads, and
o_proj / down_proj swapped for `RowParallelLinear`: `DecoderRunner` runs it unchanged (it calls a module that
is not a plain Linear), fused q/k/v and gate/up per shard included (native_fused.py). Parameters keep their HF
names; `tp_slice(name, full, rank, size)` is the rule every weight transport applies to a full tensor
(distributed/weights/tensor_parallel.py).

Vocabulary: the lm_head is split (vocab_parallel.py), the embedding replicated. Splitting the head divides
its GEMM (~7% of a 7B decode step's FLOPs) and the sampler's passes over the logits (cast, exp, cumsum over
152k entries a row at 7B) by TP, for two small all-reduces per sampling step; the samples are those of the
one-GPU sampler (same uniforms, same inverse-CDF rule) up to fp32 rounding of the split sums. The
embedding stays replicated: a lookup costs no FLOPs, and splitting it would add an all-reduce of [tokens,
hidden] to every forward, so it would save memory (1.1 GB bf16 a rank at 7B, untied) but cost time; a tied
head is then a view of the embedding's rows (no memory, refreshed with the embedding). `vocab_parallel=False`
(shard_model / tp_slice) keeps the head replicated: every rank computes the same full logits from the same
all-reduced hidden state and samples alone (bench/tp_decode.py --replicated-head, for comparison).

Lock step (`TPNativeEngine`): the collectives inside every forward need every rank to run the same rounds
with the same requests. Rank 0 of the group (the leader) is the engine callers talk to (`generate`); at the
start of each round it broadcasts what the round takes in (new requests, the ids of requests cancelled since
the last round) and every other rank (a follower, inside `follow()`) replays that round on its own shard with
the same requests, the same engine seed (agreed at construction) and the same logits, so every scheduling
decision (admission, decode steps, retirement) is the same on all ranks. Followers' results are dropped.
Cancellation is snapshotted by the leader per round (its rounds run on copies of the callers' requests that
no caller can cancel mid-round). Every other engine call (load_weights, sleep, wake_up, close) is made by
every rank itself, between rounds (a colocated policy's ranks all call them in `sync`). `release()` (leader)
ends the followers' `follow()`.

Round messages (`control_device`): the only traffic outside the forward passes is ONE broadcast a round
(every `sync_every` decode steps, as the one-GPU engine's host sync): a fixed [2] int64 header (round or
stop, payload bytes), followed by a second broadcast of the pickled (new requests, cancelled ids) only in
rounds that carry any. Nothing else is agreed between ranks at run time: finished slots, stop tokens, the
decode batch and the kv bucket follow from the tokens, which the vocab-parallel sampler makes identical on
every rank, and from host bookkeeping every rank does alike. The messages travel over the group's CPU
backend (gloo; a `cpu:gloo,cuda:nccl` group, as distributed/group.py creates) where it has one, so a round
start costs a follower no device sync and the leader no device copy or NCCL launch: before that, each round's
`broadcast_object_list` over NCCL ran two NCCL broadcasts, two host-to-device copies and, on each follower,
two device syncs (`.item()`, `.cpu()`) while the leader's GPU waited for the follower's first replay at the
first all-reduce. A group with no CPU backend (NCCL only) sends them through its device, as before. Cancelled
callers and finished shadows are queued by their futures' callbacks (no pass over every in-flight request a
round).
"""

from __future__ import annotations

import concurrent.futures
import copy
import inspect
import pickle
import random
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relayrl.rollout.base import EngineCapabilities, GenerationRequest, GenerationResult
from relayrl.rollout.driver import Pending
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.native_moe import MOE_MODEL_TYPES
from relayrl.rollout.tp_allreduce import FastAllReduce, resolve_impl, setup_fast_all_reduce
from relayrl.rollout.vocab_parallel import VocabParallelHead, vocab_bounds

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Modules whose output rows (weight dim 0, bias) are split over the TP ranks."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Modules whose input columns (weight dim 1) are split; their output is all-reduced, their bias replicated."""
VOCAB_PARALLEL = ("lm_head",)
"""Modules whose output rows (the vocabulary) are cut as torch.tensor_split cuts them (any vocabulary size)."""


def split_dim(name: str) -> int | None:
    """The dimension of parameter `name` (HF naming) split over TP ranks; None: replicated."""
    module, _, leaf = name.rpartition(".")
    module = module.rpartition(".")[2]
    if module in COLUMN_PARALLEL or module in VOCAB_PARALLEL:
        return 0
    if module in ROW_PARALLEL and leaf == "weight":
        return 1
    return None


def tp_slice(
    name: str, full: torch.Tensor, rank: int, size: int, vocab_parallel: bool = True
) -> torch.Tensor:
    """Rank `rank`'s slice (a view) of the full tensor of parameter `name` (module doc); `vocab_parallel`
    False: the lm_head replicated (it must match the shard's `shard_model(vocab_parallel=...)`)."""
    dim = split_dim(name)
    if dim is None or size == 1:
        return full
    if name.rpartition(".")[0].rpartition(".")[2] in VOCAB_PARALLEL:
        return full.tensor_split(size, dim)[rank] if vocab_parallel else full
    return full.chunk(size, dim)[rank]


def check_shardable(config: Any, size: int) -> None:
    """A ValueError naming the model dimension that `size` ranks do not divide (or a mixture-of-experts model,
    whose experts this engine does not shard)."""
    if size > 1 and getattr(config, "model_type", None) in MOE_MODEL_TYPES:
        raise ValueError(
            f"tensor-parallel native engine: {config.model_type} is a mixture-of-experts model and its experts "
            "are not sharded yet; use dist.engine_tp 1 (one card holds every expert) or the vllm engine"
        )
    heads = config.num_attention_heads
    dims = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
    }
    for field, value in dims.items():
        if value % size:
            raise ValueError(
                f"tensor-parallel native engine: the model's {field}={value} is not divisible by the TP size "
                f"{size} (dist.engine_tp); pick a TP size dividing {field} (KV heads are split, not replicated)"
            )


class RowParallelLinear(torch.nn.Linear):
    """A row-parallel Linear: this rank's input columns; the partial products summed over `group` by one
    all-reduce; the (replicated) bias added once, after it. With `fast` (set by TPNativeEngine on GPUs,
    tp_allreduce.py) a product that fits its buffer is written straight into it and summed there (the same
    GEMM, a faster all-reduce); anything else goes through NCCL (dist.all_reduce)."""

    group: Any = None
    """The TP process group."""
    fast: FastAllReduce | None = None
    """The symmetric-memory all-reduce (tp_allreduce.py), or None: NCCL for every call."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        fast, n = self.fast, self.out_features
        if fast is not None and fast.fits(input.numel() // self.in_features * n, input.dtype):
            x = input.reshape(-1, self.in_features)
            part = fast.slot(x.shape[0], n)
            with torch.no_grad():  # an engine's layer (out= takes no autograd; nor does dist.all_reduce)
                torch.mm(x, self.weight.t(), out=part)
            y = fast.reduce(part).view(*input.shape[:-1], n)
        else:
            y = F.linear(input, self.weight)
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def shard_model(
    model: torch.nn.Module,
    *,
    rank: int,
    size: int,
    group: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    vocab_parallel: bool = True,
) -> torch.nn.Module:
    """Rank `rank`'s shard of an HF Llama-layout causal LM (module doc): its own parameters (requires_grad
    False) in `dtype` on `device`, copied slice by slice (never a full copy). Parameters of a model on the
    meta device become zero tensors of the slice's shape (the caller fills them: a benchmark's random
    weights, or the first weight refresh from a policy initialised after sharding; zeros, not uninitialised
    memory, so an engine that captures or runs before that refresh never meets NaN). `vocab_parallel` (TP >
    1): the lm_head split over the ranks (vocab_parallel.py), else replicated."""
    cfg: Any = model.config
    check_shardable(cfg, size)
    memo: dict[int, object] = {}
    for name, p in model.named_parameters():  # tied weights: one name, one copy (the memo ties them back)
        local = tp_slice(name, p.detach(), rank, size, vocab_parallel)
        kind = dtype or p.dtype
        if p.is_meta:
            t = torch.zeros(local.shape, dtype=kind, device=device)
        else:
            t = local.to(device=device or p.device, dtype=kind).contiguous().clone()
        memo[id(p)] = torch.nn.Parameter(t, requires_grad=False)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shard: Any = copy.deepcopy(model, memo)  # an HF causal LM (untyped config and children)
    scfg = shard.config
    scfg.head_dim = head_dim  # explicit: hidden_size // local heads would be wrong
    scfg.num_attention_heads = cfg.num_attention_heads // size
    scfg.num_key_value_heads = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // size
    scfg.intermediate_size = cfg.intermediate_size // size
    for lin in shard.modules():
        if isinstance(lin, torch.nn.Linear):  # the sliced shapes
            lin.out_features, lin.in_features = lin.weight.shape
    for layer in shard.model.layers if size > 1 else []:  # one rank: nothing to reduce
        for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            lin = getattr(owner, name)
            if type(lin) is not torch.nn.Linear:
                raise ValueError(
                    f"tensor-parallel native engine: {name} is a {type(lin).__name__}, not a plain Linear "
                    "(LoRA adapters are not supported with TP; merge them or use dist.engine_tp 1)"
                )
            lin.__class__ = RowParallelLinear  # same parameters and fields; forward adds the all-reduce
            lin.group = group
    if size > 1 and vocab_parallel:
        split_head(shard, cfg.vocab_size, rank=rank, size=size, group=group)
    real_rotary(shard, device)
    shard.eval()
    return shard


def split_head(shard: Any, vocab: int, *, rank: int, size: int, group: Any) -> None:
    """Make the shard's lm_head a VocabParallelHead over its rows (already sliced by `tp_slice` when untied;
    tied: a view of the replicated embedding's rows, which `tp_slice` leaves whole)."""
    linear = shard.lm_head
    if type(linear) is not torch.nn.Linear:
        raise ValueError(f"tensor-parallel native engine: lm_head is a {type(linear).__name__}, not a Linear")
    embed = shard.model.embed_tokens.weight
    if linear.weight is embed:  # tied
        lo, hi = vocab_bounds(vocab, size)[rank : rank + 2]
        linear.weight = torch.nn.Parameter(embed[lo:hi], requires_grad=False)  # a view: shares storage
        linear.out_features = hi - lo
    linear.__class__ = VocabParallelHead  # same parameters; forward gives the rows' logits
    head = cast(VocabParallelHead, linear)
    head.setup(group, rank, size, vocab)


def real_rotary(model: Any, device: torch.device | str | None) -> None:
    """Rebuild the rotary tables of an HF Llama-layout model copied from one on the meta device (its
    buffers hold no data) on `device`; nothing when they are real."""
    rot = model.model.rotary_emb
    if any(b.is_meta for b in rot.buffers()):
        with torch.device(device or "cpu"):
            model.model.rotary_emb = type(rot)(config=model.config)


def _drain(queue: deque[int]) -> list[int]:
    """Pop everything `queue` holds now (other threads may append meanwhile: those wait for the next call)."""
    out = []
    while queue:
        out.append(queue.popleft())
    return out


def _relay(real: Pending, future: concurrent.futures.Future) -> None:
    """Copy a finished shadow's outcome to the caller's future."""
    if real.future.done():
        return
    exc = future.exception() if not future.cancelled() else None
    if future.cancelled():
        real.abort()
    elif exc is not None:
        real.fail(exc)
    else:
        real.future.set_result(future.result())


CONTROLS = ("auto", "cpu", "device")
"""TPNativeEngine(control=...): where round messages travel (`control_device`)."""
HEADER = 2
"""A round message's header: [kind, payload bytes]."""
ROUND, STOP = 0, 1
"""Header kinds: run a round / end `follow()`."""


def control_device(group: Any, device: torch.device, control: str = "auto") -> torch.device:
    """The device of the round messages over `group` (module doc): "auto" the CPU when the group has a CPU
    backend (gloo; dist.get_backend_config lists "cpu:") or the engine runs on the CPU, else `device`; "cpu"
    requires a CPU backend; "device": `device` (NCCL on GPUs: the path before CPU messages)."""
    if control not in CONTROLS:
        raise ValueError(f"TPNativeEngine(control={control!r}): one of {', '.join(CONTROLS)}")
    config = str(dist.get_backend_config(group)).lower()
    has_cpu = device.type == "cpu" or any(part.strip().startswith("cpu:") for part in config.split(","))
    if control == "cpu" and not has_cpu:
        raise ValueError(
            f"TPNativeEngine(control='cpu'): the TP group's backend {config!r} has no CPU backend; create the "
            "group with backend 'cpu:gloo,cuda:nccl' (as distributed/group.py does) or pass control='auto'"
        )
    return torch.device("cpu") if has_cpu and control != "device" else device


DEFAULT_SLOTS = int(inspect.signature(NativeEngine.__init__).parameters["max_slots"].default)


def attach_all_reduce(
    model: torch.nn.Module, group: Any, rows: int, allreduce: str | FastAllReduce | None
) -> FastAllReduce | None:
    """Give every RowParallelLinear of `model` the all-reduce `allreduce` names (tp_allreduce.IMPLS; None:
    $RELAYRL_TP_ALLREDUCE or "auto"), built for [<= rows, hidden] before any graph capture, or a ready
    FastAllReduce (a test's stand-in); returns it (None: NCCL). Collective over `group` on GPUs."""
    lins = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    fast = allreduce if isinstance(allreduce, FastAllReduce) else None
    if lins and not isinstance(allreduce, FastAllReduce):
        w = lins[0].weight
        fast = setup_fast_all_reduce(
            group, w.device, w.dtype, rows, lins[0].out_features, resolve_impl(allreduce)
        )
    for lin in lins:
        lin.fast = fast
    return fast


class TPNativeEngine(NativeEngine):
    """The native engine over one TP shard (`shard_model`), in lock step with the other ranks of `group`
    (module doc). Keywords are NativeEngine's plus `allreduce` (`attach_all_reduce`: "auto", the default,
    sums the row-parallel layers' outputs through symmetric memory on GPUs where it works, else NCCL;
    tp_allreduce.py) and `control` (`control_device`: "auto", the default, sends the round messages over
    the group's CPU backend where it has one); `seed` (None: drawn by the leader) is agreed by all ranks."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities(fixed_slots=True, tensor_parallel=True)

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, group: Any, **opts: Any) -> None:
        self.group = group
        self.leader = dist.get_global_rank(group, 0)
        self.is_leader = dist.get_rank(group) == 0
        device = next(model.parameters()).device
        self.control_device = control_device(group, device, opts.pop("control", "auto"))
        """Where the round messages travel (`control_device`): the CPU (the group's gloo backend) unless the
        group has none or control="device"."""
        self._header = torch.zeros(HEADER, dtype=torch.long, device=self.control_device)
        self.control_messages = 0
        """Broadcasts of round messages this rank took part in (a round: 1; 2 when it carries requests or
        cancellations)."""
        seed = opts.pop("seed", None)
        seed = self._bcast_object(("seed", random.getrandbits(31) if seed is None else seed))[1]
        if device.type == "cuda":  # NCCL builds its communicator lazily: before any graph capture
            with torch.cuda.device(device):
                dist.all_reduce(torch.zeros(1, device=device), group=group)
        rows = opts.get("max_slots") or DEFAULT_SLOTS
        self.fast_all_reduce = attach_all_reduce(model, group, rows, opts.pop("allreduce", None))
        """The row-parallel layers' symmetric-memory all-reduce (tp_allreduce.py); None: NCCL."""
        self._callers: dict[int, Pending] = {}
        """Leader: id -> the caller's pending of each request in flight."""
        self._shadows: dict[int, Pending] = {}
        """id -> the pending the rounds run on (never cancelled by a caller; see module doc)."""
        self._next_id = 0
        self._cancelled_ids: deque[int] = deque()
        """Leader: ids of callers' requests cancelled since the last round message (their futures' callbacks, in
        the cancelling thread; no scan of every request a round)."""
        self._done_ids: deque[int] = deque()
        """ids of shadows finished since the last round's end (their futures' callbacks)."""
        self._follow_msg: tuple[list[GenerationRequest], list[int]] = ([], [])
        super().__init__(model, tokenizer, seed=seed, **opts)
        self.tp_size = dist.get_world_size(group)

    def _bcast_object(self, msg: Any) -> Any:
        """The leader's `msg` on every rank (broadcast_object_list over the control device; construction)."""
        box = [msg if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group, device=self.control_device)
        return box[0]

    def _send(self, kind: int, requests: list[GenerationRequest], cancelled: list[int]) -> None:
        """Leader: one round message (module doc, "Round messages")."""
        payload = pickle.dumps((requests, cancelled)) if requests or cancelled else b""
        self._header.copy_(torch.tensor([kind, len(payload)]))
        dist.broadcast(self._header, src=self.leader, group=self.group)
        self.control_messages += 1
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.control_device)
            dist.broadcast(data, src=self.leader, group=self.group)
            self.control_messages += 1

    def _receive(self) -> tuple[int, list[GenerationRequest], list[int]]:
        """Follower: the leader's next round message (kind, new requests, cancelled ids)."""
        dist.broadcast(self._header, src=self.leader, group=self.group)
        self.control_messages += 1
        kind, size = self._header.tolist()  # on the CPU: no device sync
        if not size:
            return kind, [], []
        data = torch.empty(size, dtype=torch.uint8, device=self.control_device)
        dist.broadcast(data, src=self.leader, group=self.group)
        self.control_messages += 1
        requests, cancelled = pickle.loads(data.cpu().numpy().tobytes())
        return kind, requests, cancelled

    # ---- leader ---------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if not self.is_leader:
            raise RuntimeError(
                "tensor-parallel native engine: only TP rank 0 takes requests; others follow()"
            )
        return await super().generate(request)

    def release(self) -> None:
        """Leader: end the followers' `follow()` (call when this rollout's requests are all done)."""
        with self._round_lock:
            self._send(STOP, [], [])

    # ---- follower -------------------------------------------------------------------------------------
    def follow(self) -> int:
        """Follower: replay the leader's rounds until its `release()`; returns the rounds run."""
        if self.is_leader:
            raise RuntimeError("follow() runs on TP ranks > 0; the leader calls release() instead")
        rounds = 0
        while True:
            kind, requests, cancelled = self._receive()
            if kind == STOP:
                return rounds
            self._follow_msg = (requests, cancelled)
            with self._round_lock, torch.no_grad():
                self._step([])
            rounds += 1

    # ---- the round, on every rank ---------------------------------------------------------------------
    def _round(self, new: list[Pending]) -> None:
        if self.is_leader:
            cancelled = _drain(self._cancelled_ids)
            requests = [p.request for p in new]
            self._send(ROUND, requests, cancelled)
        else:
            requests, cancelled = self._follow_msg
        for i in cancelled:
            self._callers.pop(i, None)
            shadow = self._shadows.pop(i, None)
            if shadow is not None:
                shadow.future.cancel()
        shadows = []
        for k, request in enumerate(requests):
            i, shadow = self._next_id, Pending(request=request)
            self._shadows[i] = shadow
            shadow.future.add_done_callback(lambda f, i=i: self._done_ids.append(i))
            if self.is_leader:
                real = new[k]
                self._callers[i] = real
                shadow.future.add_done_callback(lambda f, real=real: _relay(real, f))
                real.future.add_done_callback(lambda f, i=i: f.cancelled() and self._cancelled_ids.append(i))
            self._next_id += 1
            shadows.append(shadow)
        super()._round(shadows)
        for i in _drain(self._done_ids):
            self._shadows.pop(i, None)
            self._callers.pop(i, None)

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        if named_tensors is not None:
            raise ValueError(
                "tensor-parallel native engine: load_weights takes None (the shard's slices were written in "
                "place by distributed/weights/tensor_parallel.py); full named tensors would not fit the shard"
            )
        super()._load(None)
