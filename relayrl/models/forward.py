"""One model forward for every trainer: hidden states and per-token log-probs of variable-length sequences,
with attention cost linear in the micro-batch (no dense [N, N] mask is ever built).

Data. A micro-batch is a list of S token sequences, each a 1-D LongTensor (lengths L_i >= 1, N = sum L_i).
Every result is FLAT, one row per real token in the order of the sequences:

    hidden = forward_hidden(model, seqs, layout)              # [N, H]  last hidden state (after the final norm)
    logp, ent = token_logprobs(model, seqs, layout, temperature=0.7, entropy=True)   # [N] float32 each
    v = token_values(critic, seqs, layout)                    # [N] float32  value head on every token
    per_seq = split_flat(logp, lengths); rows = to_padded(logp, lengths, width)      # [B, T] callers

Token alignment: logp[j] = log pi(token j | the earlier tokens of its own sequence) under
softmax(logits / temperature); it is scored by the hidden state of token j - 1 of the same sequence, so the
first token of every sequence has no prefix and gets logp = 0 and entropy = 0. `token_values` is NOT
shifted: v[j] is the value head on token j's own hidden state (the caller shifts, as for any critic).

Layouts (relayrl.data.packing.LAYOUTS; pick one with `choose_layout`, apply it once with `prepare_model`,
cut rows with relayrl.data.packing.plan_micro_batches):

    varlen  the S sequences concatenated into ONE [1, N] row, position ids restarting at 0 per sequence,
            cu_seqlens int32 [S + 1] and the longest length passed to the model as the FlashAttention
            kwargs (cu_seq_lens_q/k, max_length_q/k). They reach our attention function, registered in
            transformers' AttentionInterface as "relayrl_varlen", which calls
            torch.nn.attention.varlen.varlen_attn (flash, causal = window_size (-1, 0)): cost sum L_i^2,
            no padding, no mask. Its mask function returns None inside `forward_hidden`, so transformers
            builds no mask. Outside `forward_hidden` (HF generate, a plain `model(...)` call) both functions
            hand over to sdpa, so a switched model still behaves exactly like an sdpa model there.
            Flash kernels take fp16 / bf16 only: under autocast q/k/v are cast to the autocast dtype (as
            sdpa is); float32 q/k/v outside autocast, and CPU tensors, run each sequence through causal
            sdpa on its own instead (exact, same cost order, one launch per sequence: logged once).
    padded  one right-padded [S, T_max] row per sequence, attention_mask=None and plain causal sdpa (or
            eager): padding sits at the end, so no real token ever attends to it, and transformers' sdpa
            path passes is_causal=True with no mask. Cost S * T_max^2, hence `plan_micro_batches` puts
            rows of similar length together (sorted by length, rows * longest <= budget).
    exact   (rollout.exact) token_logprobs through the native engine's forward, rollout/exact.py; else padded.
    Under sequence parallelism (dist.sp_size > 1, relayrl.models.sequence_parallel) always varlen: each rank
    runs its slice of the packed row; log-probs / values come back for the whole row.

How the choice is made: "varlen" on a CUDA device when torch has `varlen_attn` and the architecture can
take it (transformers can switch its attention function, no sliding window, no logit soft-capping), else
"padded"; the choice is logged once per process (logger "relayrl.models.forward"). The native rollout
engine (relayrl/rollout/native_model.py) calls the projection and norm modules itself with its own
attention, so switching the attention function does not touch it.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import sys
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from relayrl.data.packing import check_layout
from relayrl.models import sequence_parallel as sp
from relayrl.models.logprobs import head_logprobs
from relayrl.models.packed_rows import skip_packed_detection
from relayrl.models.value_head import head_values
from relayrl.rollout.exact import ExactRunner

try:  # torch >= 2.10, CUDA (flash) only
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None

log = logging.getLogger(__name__)

ATTN_NAME = "relayrl_varlen"
"""Name of our attention function in transformers' AttentionInterface / AttentionMaskInterface."""

_IN_VARLEN_FORWARD = contextvars.ContextVar("relayrl_in_varlen_forward", default=False)
_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


# ---------------------------------------------------------------- the attention function and its mask


@functools.cache
def _kernel_params() -> frozenset[str]:
    """Keyword names of this torch's varlen_attn: torch 2.13 takes enable_gqa, 2.11 does not (then K/V are
    expanded to every query head); causality is window_size=(-1, 0) (an older is_causal flag is used if
    present); the default scale 1/sqrt(D) is folded into q when there is no `scale`."""
    return frozenset(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else frozenset()


def _compute_dtype(q: Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def _kernel_usable(q: Tensor) -> bool:
    return _varlen_attn is not None and q.is_cuda and _compute_dtype(q) in (torch.float16, torch.bfloat16)


def _kernel(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale: float | None
) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] through the flash varlen kernel (causal)."""
    params = _kernel_params()
    dtype = _compute_dtype(q)
    if scale is not None and "scale" not in params:
        q = q * (scale * q.shape[-1] ** 0.5)  # the kernel applies 1/sqrt(D)
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    extra: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        extra["scale"] = scale
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # query head h reads KV head h // group, as transformers' repeat_kv does
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    assert _varlen_attn is not None  # _kernel_usable checked it
    out = _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)
    assert isinstance(out, Tensor)  # no return_aux requested
    return out


def _per_sequence(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scale: float | None) -> Tensor:
    """Exact fallback: causal sdpa over each sequence alone. query [1, Hq, N, D] -> [1, N, Hq, D]."""
    if query.is_cuda:
        _log_once(
            logging.WARNING,
            f"varlen attention: {query.dtype} q/k/v outside autocast (flash kernels take fp16/bf16 only), so "
            "each sequence runs through sdpa on its own; use bf16 autocast or a bf16 model for the varlen kernel",
        )
    bounds = cu.tolist()
    gqa = key.shape[1] != query.shape[1]
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scale, enable_gqa=gqa
        )
        for s, e in pairwise(bounds)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2)


def _check_call(module: Any, query: Tensor, dropout: float, kwargs: dict[str, Any]) -> None:
    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if unsupported or dropout:
        raise ValueError(
            f"{ATTN_NAME} attention supports plain causal attention only; {type(module).__name__} asked for "
            f"{unsupported or f'dropout={dropout}'}: use the 'padded' layout for this model"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_NAME} attention expects one packed [1, N] row, got batch {query.shape[0]}")


def varlen_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: query [1, Hq, N, D], key/value [1, Hkv, N, D] -> ([1, N, Hq, D], None).

    With `cu_seq_lens_q` in kwargs (a `forward_hidden` varlen call): causal attention inside each
    sequence of the packed row. Without it: transformers' sdpa function with the mask it was given.
    """
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None:
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    _check_call(module, query, dropout, kwargs)
    group = sp.active()
    if group is not None:  # Ulysses: this rank's tokens of every head -> every token of its heads
        query = sp.seq_to_heads(query)
        key, value = (sp.seq_to_heads(sp.expand_kv(x, group.size)) for x in (key, value))
    if not _kernel_usable(query):
        out = _per_sequence(query, key, value, cu_q, scaling)
    else:
        cu_k = kwargs.get("cu_seq_lens_k", cu_q)
        max_q = int(kwargs["max_length_q"])
        max_k = int(kwargs.get("max_length_k", max_q))
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, D]
        out = _kernel(q, k, v, cu_q, cu_k, max_q, max_k, scaling).unsqueeze(0)
    return (sp.heads_to_seq(out) if group is not None else out), None


def _varlen_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """transformers mask function: no mask inside `forward_hidden`'s varlen call, sdpa's mask elsewhere."""
    if _IN_VARLEN_FORWARD.get():
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


@functools.cache
def _register() -> None:
    AttentionInterface.register(ATTN_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTN_NAME, _varlen_mask)
    skip_packed_detection(_IN_VARLEN_FORWARD.get)  # its mask is None there: no device sync to detect packing


# ---------------------------------------------------------------- choosing and applying a layout


def hf_model(model: Any) -> Any:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _architecture_blocker(hf: Any) -> str | None:
    """Why this model cannot take our attention function (None when it can)."""
    cfg = hf.config
    can_set = getattr(type(hf), "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return f"{type(hf).__name__} cannot switch its attention function"
    if getattr(cfg, "sliding_window", None) is not None or "sliding_attention" in (
        getattr(cfg, "layer_types", None) or ()
    ):
        return "sliding-window attention"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    return "vision-language model (3-D rope positions)" if getattr(cfg, "vision_config", None) else None


def choose_layout(model: Any, device: torch.device | str) -> str:
    """ "varlen" on CUDA when torch has varlen_attn and the architecture can take it, else "padded"; "varlen"
    on any device under sequence parallelism (it splits a packed row; a CPU runs attention per sequence)."""
    device = torch.device(device)
    if sp.size() > 1 and (blocker := _architecture_blocker(hf_model(model))) is not None:
        raise ValueError(f"dist.sp_size > 1 needs the varlen layout; this model cannot take it ({blocker})")
    if sp.size() > 1:
        return "varlen"
    if device.type != "cuda":
        blocker = f"{device.type} device"
    elif _varlen_attn is None:
        blocker = f"torch {torch.__version__} has no varlen_attn"
    else:
        blocker = _architecture_blocker(hf_model(model))
    if blocker is None:
        _log_once(logging.INFO, "attention layout: varlen (torch varlen_attn, cu_seqlens)")
        return "varlen"
    _log_once(logging.INFO, f"attention layout: padded (length-bucketed, causal, no mask): {blocker}")
    return "padded"


def _set_attention(hf: Any, name: str) -> None:
    if hf.config._attn_implementation == name:
        return
    hf.set_attn_implementation(name)
    if hf.config._attn_implementation != name:
        raise RuntimeError(f"{type(hf).__name__} did not switch its attention implementation to {name!r}")


def prepare_model(model: Any, layout: str) -> Any:
    """Make `model` (or the model under a peft wrapper) ready for `layout`; returns `model`.

    varlen: register our attention and mask functions (once) and switch the model to them. padded: keep
    sdpa or eager, switch anything else (our varlen, flash, flex) to sdpa.
    """
    check_layout(layout)
    hf = hf_model(model)
    if layout == "varlen":
        blocker = _architecture_blocker(hf)
        if blocker is not None:
            raise ValueError(f"layout 'varlen' does not fit this model ({blocker}); use 'padded'")
        _register()
        _set_attention(hf, ATTN_NAME)
    elif hf.config._attn_implementation not in ("sdpa", "eager"):
        _set_attention(hf, "sdpa")
    return model


# ---------------------------------------------------------------- forwards


def _lengths(seqs: Sequence[Tensor]) -> list[int]:
    if len(seqs) == 0:
        raise ValueError("forward needs at least one sequence")
    for i, s in enumerate(seqs):
        if s.dim() != 1 or s.numel() == 0:
            raise ValueError(f"sequence {i} must be a non-empty 1-D token tensor, got shape {tuple(s.shape)}")
    return [int(s.numel()) for s in seqs]


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without stalling the GPU: staged through pinned memory and copied
    asynchronously (a copy from pageable memory would wait for every queued kernel first)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _varlen_hidden(trunk: Any, ids: Tensor, lengths: list[int]) -> Tensor:
    """[N, H] hidden states of the packed row; under sequence parallelism this rank's slice of the row padded
    to a multiple of the group size (models.sequence_parallel: the padding is a sequence of its own)."""
    device = ids.device
    lo, hi, padded = sp.local_slice(ids.numel())
    lengths = lengths + ([padded - ids.numel()] if padded > ids.numel() else [])
    starts = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32)
    counts = torch.tensor(lengths)
    positions = (torch.arange(int(starts[-1])) - torch.repeat_interleave(starts[:-1].long(), counts))[lo:hi]
    ids = sp.pad_to(ids, padded, 0)[lo:hi]
    cu, max_len = to_device(starts, device), max(lengths)
    token = _IN_VARLEN_FORWARD.set(True)
    try:
        out = trunk(
            input_ids=ids[None],
            position_ids=to_device(positions, device)[None],
            attention_mask=None,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max_len,
            max_length_k=max_len,
        )
    finally:
        _IN_VARLEN_FORWARD.reset(token)
    return out[0]


def _padded_hidden(trunk: Any, ids: Tensor, lengths: list[int]) -> Tensor:
    rows = torch.nn.utils.rnn.pad_sequence(list(ids.split(lengths)), batch_first=True)
    real = (
        torch.arange(rows.shape[1], device=ids.device)[None]
        < to_device(torch.tensor(lengths), ids.device)[:, None]
    )
    hidden = trunk(input_ids=rows, attention_mask=None, use_cache=False)
    return hidden[real]


def forward_hidden(model: Any, seqs: Sequence[Tensor], layout: str) -> Tensor:
    """Last hidden states [N, H] (after the final norm) of every real token, flattened in order of `seqs`.

    Works for causal LMs and value-head models (the trunk is `hf.<base_model_prefix>`), under peft too.
    Differentiable. The varlen layout needs `prepare_model(model, "varlen")` first.
    """
    if sp.size() > 1:  # the head would run on every rank's gathered states (gradients W times over)
        raise ValueError("dist.sp_size > 1 covers token log-probs and values; this loss reads hidden states")
    return _hidden(model, seqs, layout)


def _hidden(model: Any, seqs: Sequence[Tensor], layout: str) -> Tensor:
    """`forward_hidden`'s states; under sequence parallelism only this rank's slice of the packed row."""
    check_layout(layout)
    lengths = _lengths(seqs)
    hf = hf_model(model)
    if layout == "varlen" and hf.config._attn_implementation != ATTN_NAME:
        raise ValueError(
            f"layout 'varlen' needs the model switched to {ATTN_NAME!r} attention (it uses "
            f"{hf.config._attn_implementation!r}): call prepare_model(model, 'varlen') once after loading"
        )
    trunk = _Trunk(hf)
    device = _input_device(hf, trunk.root)
    ids = to_device(torch.cat(list(seqs)).long(), device)
    if layout == "varlen":
        return _varlen_hidden(trunk, ids, lengths)
    return _padded_hidden(trunk, ids, lengths)


class _Trunk:
    """Calls the decoder trunk (`hf.<base_model_prefix>`) and returns its last hidden states [B, T, H].

    A model sharded with FSDP2 (relayrl.distributed.fsdp) has the transformers model as its root unit, whose
    forward hooks gather the root weights (embeddings, norm, heads) and schedule the gradient reduction; so
    for it the whole model runs (a causal LM computes the logits of one position only: logits_to_keep=1) and
    the trunk's output is taken from a forward hook. Unsharded models call the trunk directly."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.trunk = getattr(hf, hf.base_model_prefix)
        self.root = _is_fsdp_root(hf)

    def __call__(self, **kwargs: Any) -> Tensor:
        if not self.root:
            return self.trunk(**kwargs).last_hidden_state
        seen: list[Tensor] = []
        handle = self.trunk.register_forward_hook(lambda m, a, out: seen.append(out.last_hidden_state))
        try:
            if self.hf.get_output_embeddings() is not None:
                kwargs["logits_to_keep"] = 1
            self.hf(**kwargs)
        finally:
            handle.remove()
        return seen[-1]


def _input_device(hf: Any, sharded: bool) -> torch.device:
    """Where the inputs go: the parameters' device, or for a sharded model its mesh's device (a CPU-offloaded
    model keeps its shards on the CPU and computes on the GPU)."""
    p = next(hf.parameters())
    mesh = getattr(p, "device_mesh", None) if sharded else None
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return p.device


def _is_fsdp_root(hf: Any) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(hf, fsdp.FSDPModule)


def token_logprobs(
    model: Any,
    seqs: Sequence[Tensor],
    layout: str,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(logp [N] float32, entropy [N] float32 or None) of every token given its sequence's earlier tokens.

    logp[j] = log softmax(lm_head(h[j-1]) / temperature)[token j], h[j-1] the hidden state of the previous
    token of the same sequence; entropy[j] that distribution's entropy. The first token of each sequence
    gets 0 for both. Through relayrl.models.logprobs (chunked: no [N, V] float32 logits).
    """
    hf = hf_model(model)
    head = hf.get_output_embeddings()
    if head is None:
        raise ValueError(
            f"{type(hf).__name__} has no output embedding (LM head): token_logprobs needs a causal LM"
        )
    lengths = _lengths(seqs)
    if layout == "exact":  # the rollout engine's batch-invariant forward (exact on-policy mode)
        return ExactRunner(hf, max(lengths)).sequence_logprobs(seqs, temperature, entropy)
    hidden = _hidden(model, seqs, layout)
    tokens = torch.cat(list(seqs)).long()
    vocab = head.weight.shape[0]
    bounds = torch.stack([tokens.min(), tokens.max()]).tolist() if tokens.numel() else [0, 0]  # one read
    if bounds[0] < 0 or bounds[1] >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}); got {bounds}")
    first = torch.zeros(tokens.numel(), dtype=torch.bool, device=tokens.device)
    first[to_device(torch.tensor([0, *accumulate(lengths[:-1])]), tokens.device)] = True
    # row j scores token j + 1; the last token of a sequence scores nothing (ignore_index -> logp 0)
    targets = torch.cat([tokens[1:].masked_fill(first[1:], -100), tokens.new_full((1,), -100)])
    targets, first = to_device(targets, hidden.device), to_device(first, hidden.device)
    lo, hi, padded = sp.local_slice(tokens.numel())  # targets shifted before the split: a shard's last
    lp, ent = head_logprobs(  # token is scored by the next shard's first
        hidden,
        head.weight,
        sp.pad_to(targets, padded, -100)[lo:hi],
        bias=head.bias,
        temperature=temperature,
        with_entropy=entropy,
        check_targets=False,
    )
    lp, ent = (
        sp.gather_tokens(lp, tokens.numel()),
        (ent if ent is None else sp.gather_tokens(ent, tokens.numel())),
    )
    logp = F.pad(lp[:-1], (1, 0))
    if ent is not None:
        ent = F.pad(ent[:-1], (1, 0)).masked_fill(first, 0.0)
    return logp, ent


def token_values(model: Any, seqs: Sequence[Tensor], layout: str) -> Tensor:
    """Value head (`score`, hidden -> 1) on every token's own hidden state: [N] float32, not shifted."""
    return sp.gather_tokens(head_values(model, _hidden(model, seqs, layout)), sum(_lengths(seqs)))


# ---------------------------------------------------------------- flat <-> per-sequence helpers


def split_flat(flat: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    """[N, ...] -> one [L_i, ...] tensor per sequence (views)."""
    if flat.shape[0] != sum(lengths):
        raise ValueError(f"flat has {flat.shape[0]} rows but the lengths sum to {sum(lengths)}")
    return list(flat.split(list(lengths)))


def to_padded(flat: Tensor, lengths: Sequence[int], width: int) -> Tensor:
    """[N, ...] -> [S, width, ...]: row i holds sequence i's values at columns [0, L_i), zeros elsewhere.

    Differentiable w.r.t. `flat`.
    """
    if flat.shape[0] != sum(lengths):
        raise ValueError(f"flat has {flat.shape[0]} rows but the lengths sum to {sum(lengths)}")
    if lengths and width < max(lengths):
        raise ValueError(f"width {width} is shorter than the longest sequence ({max(lengths)})")
    counts = torch.tensor(list(lengths))  # index math on the host, one async copy each
    rows = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(flat.shape[0]) - torch.repeat_interleave(starts, counts)
    out = flat.new_zeros((len(lengths), width, *flat.shape[1:]))
    return out.index_put((to_device(rows, flat.device), to_device(cols, flat.device)), flat)
