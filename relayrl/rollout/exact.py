"""Exact on-policy mode: one batch-invariant forward for the rollout engine and the trainer's log-probs, so the
log-prob the engine sampled a token with equals the trainer's recomputation bit for bit.

Why they differ otherwise. The engine and the trainer run the same weights through different reduction orders:
a matmul of 1-16 decode rows takes another kernel than one of a packed sequence (on this CPU, MKL's fp32 GEMM
rounds rows differently for M < 12 than for larger M; on a GPU cuBLAS picks tiles and split-K by shape),
decode attends over a padded KV cache while training attends over the whole sequence, and the vocabulary
log-softmax is a logsumexp on one side and log_softmax on the other. Each alone is ~1 ulp; through 24 layers
it is a mean |diff| ~0.01 on a bf16 0.5B model.

The approach (as batch_invariant_ops / vLLM's and SGLang's batch invariance / TorchTitan's RL experiments,
written as plain torch ops): define ONE computation per token whose every reduction has a fixed shape and
order, independent of what else is in the batch, and run it on both sides (`ExactRunner`):

- matmul (`linear`): rows go through GEMMs of exactly `row_block` rows (zero-padded), so each row meets the
  same kernel and blocking whatever the row count (tested: a row's result does not depend on its position
  in the block or on the other rows). The reduction over K is the kernel's own, the same for every call.
- RMSNorm, rotary: per row (F.rms_norm over the hidden size in fp32; rotary elementwise in fp32 from an fp32
  table) -- no cross-row reduction.
- attention (`attention`): per query, over key blocks of `key_block` positions anchored at position 0,
  scanned in order with an online softmax (running max, rescaled sum and accumulator, fp32). Both products
  (q.K and p.V) are batched GEMMs of one fixed shape per (row, KV head, block of `row_block` query rows);
  keys after the query's position are masked to -inf. A block wholly after the query is an exact no-op (max
  unchanged, rescale by exp(0) = 1, adds +0), so the result is the same whether the keys are a decode's KV
  cache padded to a length bucket, a prefill's prompt or the trainer's whole sequence.
- the residual stream, norms and K/V are in the compute dtype (the model's, or the autocast dtype: a bf16
  engine copy and fp32 master weights under bf16 autocast see the same values); attention and rotary in fp32.
- log-probs: log_softmax(logits.float() / T) per row, exactly as the engine's sampler (sampling.py).

The trainer (relayrl.models.forward, layout "exact") calls `ExactRunner.sequence_logprobs`; the engine
(NativeEngine(exact=True)) uses ExactRunner's prefill / extend / decode. Both differentiate through autograd
(the trainer's update) or not (old log-probs, the engine): the same ops either way.

Cost (docs/rl.md, measured): the fixed-row GEMMs pad decode batches to `row_block` rows; attention is
a loop of small fixed-shape GEMMs over key blocks instead of a fused kernel; the head's log-softmax sees
[tokens, V] fp32 logits (no chunked kernel).
On CUDA (`use_kernels`) ExactRunner runs the same design as Triton kernels instead (exact_kernels.py: a
fixed-tile matmul without row padding, position-anchored flash-style attention, per-row RMSNorm, per-token
rotary): the same properties, not the same bits as these torch ops -- engine and trainer on one device take
the same path, which is what equality needs. Limits: plain nn.Linear projections and HF
RMSNorm/SiLU-MLP modules only (no LoRA, no FSDP shards); a model the native engine cannot run raises there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from relayrl.rollout import exact_kernels
from relayrl.rollout.kernels import usable
from relayrl.rollout.native_model import DecoderRunner


def use_kernels(device: torch.device) -> bool:
    """ExactRunner's default: the Triton kernels (exact_kernels.py) on a CUDA device when triton imports, the
    torch ops of this module elsewhere. Both sides (engine and trainer) decide alike on the same device."""
    return device.type == "cuda" and usable(device)


def row_block(device: torch.device) -> int:
    """Rows per GEMM: 16 on a CPU (MKL's fp32 kernels agree for every block of >= 12 rows), 64 on a GPU."""
    return 64 if device.type == "cuda" else 16


def key_block(device: torch.device) -> int:
    """Key positions per attention block (the online-softmax step): 64 on a CPU (four of the eager engine's
    length buckets), 256 on a GPU (its CUDA-graph bucket). Fixed per device: both sides must use the same."""
    return 256 if device.type == "cuda" else 64


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for t's device, else t's dtype."""
    if t.is_floating_point() and torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T [K, N] (+ bias) in x's dtype, every row through a GEMM of exactly row_block rows."""
    shape, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n, block = rows.shape[0], row_block(x.device)
    rows = F.pad(rows, (0, 0, 0, (-n) % block))
    w = weight.to(x.dtype).t()
    with torch.autocast(x.device.type, enabled=False):
        if x.device.type == "cpu":  # one batched GEMM of [block, K] x [K, N] entries (tested row-invariant)
            nb = rows.shape[0] // block
            out = torch.bmm(rows.view(nb, block, k), w.expand(nb, *w.shape)).view(-1, w.shape[1])[:n]
        else:  # one GEMM per block: the same cuBLAS call whatever the row count
            out = torch.cat([b @ w for b in rows.split(block)])[:n]
        if bias is not None:
            out = out + bias.to(x.dtype)
    return out.view(*shape, -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm per row: normalise in fp32, cast back, times the weight (in x's dtype)."""
    return weight.to(x.dtype) * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _row_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [n, rows, c] -> [n * ceil(rows / block), block, c], the rows zero-padded to whole blocks."""
    _, rows, c = x.shape
    return F.pad(x, (0, 0, 0, (-rows) % block)).view(-1, block, c)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [R, Qn, H, D] (query positions q_pos [R, Qn]) over k/v [R, Hkv, L, D] (key j at position j; keys after
    a query's position are masked) -> [R, Qn, H, D] in q's dtype. See the module doc for the fixed order: the
    two products are batched GEMMs of fixed shape ([row_block, D] x [D, key_block], [row_block, key_block] x
    [key_block, D]) per (row, KV head, block of query rows), in fp32."""
    r, qn, h, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g, rb, kb_len = h // hkv, row_block(q.device), key_block(q.device)
    qg = qn * g
    qf = q.float().view(r, qn, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(r * hkv, qg, d)
    qb = _row_blocks(qf, rb)  # [r * hkv * nq, rb, d]
    nq = qb.shape[0] // (r * hkv)
    pos = q_pos[:, None, :, None].expand(r, 1, qn, g).reshape(r, 1, qg, 1)
    m = qf.new_full((r, hkv, qg), float("-inf"))
    lsum = qf.new_zeros((r, hkv, qg))
    acc = qf.new_zeros((r, hkv, qg, d))
    keys = torch.arange(kb_len, device=q.device)

    def per_query_block(t: torch.Tensor) -> torch.Tensor:  # [r, hkv, kb_len, d] -> [r * hkv * nq, kb_len, d]
        return t[:, :, None].expand(r, hkv, nq, kb_len, d).reshape(-1, kb_len, d)

    for j in range(0, length, kb_len):
        kb, vb = k[:, :, j : j + kb_len].float(), v[:, :, j : j + kb_len].float()
        if kb.shape[2] < kb_len:  # a short last block: pad to the fixed width (masked)
            kb, vb = (F.pad(t, (0, 0, 0, kb_len - t.shape[2])) for t in (kb, vb))
        s = torch.bmm(qb, per_query_block(kb).transpose(1, 2)).view(r, hkv, nq * rb, kb_len)[:, :, :qg]
        s = (s * scale).masked_fill(keys + j > pos, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        corr = torch.exp(m - m_new)
        e = torch.exp(s - m_new[..., None])
        lsum = lsum * corr + e.sum(-1)
        pv = torch.bmm(_row_blocks(e.reshape(r * hkv, qg, kb_len), rb), per_query_block(vb))
        acc = acc * corr[..., None] + pv.view(r, hkv, nq * rb, d)[:, :, :qg]
        m = m_new
    out = acc / lsum[..., None]
    return out.view(r, hkv, qn, g, d).permute(0, 2, 1, 3, 4).reshape(r, qn, h, d).to(q.dtype)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampler's log-prob (sampling.sample_tokens): log_softmax(logits.float() / T)[target] per row;
    entropy of that distribution when asked. logits [N, V], targets [N] -> [N] float32."""
    logits = logits.float()
    if temperature and temperature != 1.0:  # a [N, 1] divisor, as the sampler's per-row temperatures
        logits = logits / torch.full((logits.shape[0], 1), temperature, device=logits.device)
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    return lp, (-(logp.exp() * logp).sum(-1) if entropy else None)


def _inv_freq(rot: Any) -> torch.Tensor:
    """The rotary frequencies in fp32 recomputed from the config as HF's module does at init: its inv_freq
    buffer is cast with the model (a bf16 engine copy holds bf16-rounded frequencies, its fp32 master not)."""
    init = getattr(rot, "compute_default_rope_parameters", None)
    rope_type = getattr(rot, "rope_type", "default")
    if rope_type != "default":
        init = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init is None or getattr(rot, "config", None) is None:
        return rot.inv_freq.float()
    return init(rot.config)[0].float()


CHUNK_ELEMENTS = 2**24
"""fp32 logits per chunk of the trainer's log-prob head (as relayrl.models.logprobs)."""


def _maybe_checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), recomputed in backward when grad is on (activation checkpointing: the attention scores and
    the head's logits are not kept; the recomputation runs the same ops, so the values are the same)."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


KVFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(layer, k [R, Hkv, Qn, D], v) -> the keys/values [R, Hkv, L, D] the layer's queries attend over."""


class ExactRunner(DecoderRunner):
    """DecoderRunner's prefill / extend / decode (same signatures, so NativeEngine and its CUDA graphs use it
    unchanged) and the trainer's `sequence_logprobs`, all through the batch-invariant ops above."""

    def __init__(self, model: torch.nn.Module, max_len: int, triton_kernels: bool | None = None) -> None:
        """`triton_kernels`: run matmuls, attention and norms through exact_kernels.py (None: use_kernels,
        i.e. on CUDA); the engine and the trainer must agree (they do when both take the default)."""
        super().__init__(model, max_len, "math", fuse=False)  # (its decode attention is unused: ours runs)
        self.triton = use_kernels(self.device) if triton_kernels is None else triton_kernels
        self._linear = exact_kernels.linear if self.triton else linear
        self._rms = exact_kernels.rms_norm if self.triton else rms_norm
        for li, layer in enumerate(self.layers):
            mods = [getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            mods += [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
            if any(type(m) is not torch.nn.Linear for m in mods) or not hasattr(layer.mlp, "act_fn"):
                raise NotImplementedError(
                    f"exact mode: layer {li} has projections that are not plain nn.Linear (LoRA?) or a non-"
                    "gated MLP; exact mode supports plain Llama/Qwen-layout models (merge LoRA or turn it off)"
                )
        inv_freq = _inv_freq(self.body.rotary_emb).to(self.device)
        rot = self.body.rotary_emb
        freqs = torch.arange(max_len, device=self.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.cos32, self.sin32 = emb.cos() * scaling, emb.sin() * scaling

    def _w(self, module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        lin = cast(torch.nn.Linear, module)
        return lin.weight, lin.bias

    def _norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        return self._rms(x, cast(torch.nn.Linear, module).weight, eps)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [R, Qn, heads, D] at positions pos [R, Qn]: HF's rotary in fp32, cast back."""
        fn = exact_kernels.rope if self.triton else exact_kernels.rope_ref
        return fn(x, pos, self.cos32, self.sin32)

    def _stack(self, ids: torch.Tensor, pos: torch.Tensor, kv: KVFn, causal: bool = False) -> torch.Tensor:
        """Final-normed hidden states [R, Qn, hidden] of tokens ids [R, Qn] at positions pos [R, Qn]. Every
        dtype is explicit (the compute dtype, fp32 in attention), so autocast is off inside: it would turn the
        trainer's fp32 attention products into bf16 ones the engine does not run."""
        emb = self.body.embed_tokens.weight
        x = F.embedding(ids, emb).to(compute_dtype(emb))
        with torch.autocast(self.device.type, enabled=False):
            return self._layers(x, pos, kv, causal)

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, kv: KVFn, causal: bool) -> torch.Tensor:
        """`causal`: every row's positions are 0..Qn-1 over its own keys (the trainer: a causal backward)."""
        r, qn = pos.shape
        for li, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = self._norm(layer.input_layernorm, x)
            q = self._linear(h, *self._w(attn.q_proj)).view(r, qn, self.n_heads, self.head_dim)
            k = self._linear(h, *self._w(attn.k_proj)).view(r, qn, self.n_kv, self.head_dim)
            v = self._linear(h, *self._w(attn.v_proj)).view(r, qn, self.n_kv, self.head_dim)
            if getattr(attn, "q_norm", None) is not None:
                q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
            q, k = self._rope(q, pos), self._rope(k, pos)
            keys, values = kv(li, k.transpose(1, 2), v.transpose(1, 2))
            if self.triton:  # (its autograd Function keeps only q, k, v: nothing to checkpoint)
                o = exact_kernels.attention(q, keys, values, pos, self.scale, causal).reshape(r, qn, -1)
            else:
                o = _maybe_checkpoint(attention, q, keys, values, pos, self.scale).reshape(r, qn, -1)
            x = x + self._linear(o, *self._w(attn.o_proj))
            h = self._norm(layer.post_attention_layernorm, x)
            gate = self._linear(h, *self._w(mlp.gate_proj))
            up = self._linear(h, *self._w(mlp.up_proj))
            x = x + self._linear(F.silu(gate) * up, *self._w(mlp.down_proj))
        return self._norm(self.body.norm, x)

    def _head(self, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [.., V] in h's dtype (`weight`: the head's weight already cast, as the trainer's chunks
        pass it: one cast per pass instead of one per chunk; the same values)."""
        w, b = self._w(self.model.lm_head)
        return self._linear(h, w if weight is None else weight, b)

    # ---- engine side (DecoderRunner's interface) ---------------------------------------------------------
    def prefill(
        self,
        ids: torch.Tensor,
        last: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_idx: torch.Tensor,
        row_idx: torch.Tensor,
    ) -> torch.Tensor:
        """DecoderRunner.prefill through the batch-invariant ops."""
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).expand(b, t)

        def kv(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k_cache[li, :, :, :t].index_copy_(0, slot_idx, k.index_select(0, row_idx))
            v_cache[li, :, :, :t].index_copy_(0, slot_idx, v.index_select(0, row_idx))
            return k, v

        h = self._stack(ids, pos, kv)
        return self._head(h[torch.arange(b, device=ids.device), last])

    def extend(
        self,
        ids: torch.Tensor,
        start: list[int],
        lengths: list[int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: list[list[int]],
    ) -> torch.Tensor:
        """DecoderRunner.extend (prefill after a cached prefix; K/V into every slot of slots[b], attention
        over the first) through the batch-invariant ops."""
        b, t = ids.shape
        dev = ids.device
        start_t, first = torch.tensor(start, device=dev), torch.tensor([s[0] for s in slots], device=dev)
        pos = (start_t[:, None] + torch.arange(t, device=dev)[None, :]).clamp(max=self.max_len - 1)
        kv_len = max(s + n for s, n in zip(start, lengths, strict=True))
        # every (row, target slot) pair's real tokens (padding writes nothing): row, slot, column per token
        pair_row = torch.tensor([r for r, ss in enumerate(slots) for _ in ss], device=dev)
        pair_slot = torch.tensor([s for ss in slots for s in ss], device=dev)
        real = torch.arange(t, device=dev)[None, :] < torch.tensor(lengths, device=dev)[pair_row][:, None]
        pair, col = real.nonzero(as_tuple=True)
        row, slot = pair_row[pair], pair_slot[pair]

        def kv(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            for cache, new in ((k_cache, k), (v_cache, v)):
                cache[li][slot, :, pos[row, col]] = new[row, :, col]
            return k_cache[li, first, :, :kv_len], v_cache[li, first, :, :kv_len]

        h = self._stack(ids, pos, kv)
        last = torch.tensor([n - 1 for n in lengths], device=dev)
        return self._head(h[torch.arange(b, device=dev), last])

    def decode(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_len: int,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """DecoderRunner.decode through the batch-invariant ops (static shapes: CUDA-graph capturable)."""
        bs = tok.shape[0]
        slot = rows[:, None]

        def kv(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            heads = self.kv_heads[None, :]
            k_cache[li, slot, heads, pos[:, None]] = k[:, :, 0]
            v_cache[li, slot, heads, pos[:, None]] = v[:, :, 0]
            return k_cache[li, :bs, :, :kv_len], v_cache[li, :bs, :, :kv_len]

        return self._head(self._stack(tok[:, None], pos[:, None], kv)[:, 0])

    # ---- trainer side ------------------------------------------------------------------------------------
    def _chunk_logprobs(
        self, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = token_logprobs(self._head(h, w), targets, temperature, entropy)
        return lp, (ent if ent is not None else lp.new_zeros(0))

    def sequence_logprobs(
        self, seqs: Sequence[torch.Tensor], temperature: float, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logp [N], entropy [N] | None) float32 of every token of `seqs` given its sequence's earlier tokens,
        flat in order (models.forward.token_logprobs' contract: a sequence's first token gets 0)."""
        lengths = [int(s.numel()) for s in seqs]
        ids = torch.nn.utils.rnn.pad_sequence([s.to(self.device).long() for s in seqs], batch_first=True)
        b, t = ids.shape
        pos = torch.arange(t, device=self.device).expand(b, t)
        h = self._stack(ids, pos, lambda li, k, v: (k, v), causal=True)
        real = pos < torch.tensor(lengths, device=self.device)[:, None]
        scored = real.clone()
        scored[:, -1] = False  # h[:, j] scores token j + 1
        scored[:, :-1] &= real[:, 1:]
        targets, hs = ids[:, 1:][scored[:, :-1]], h[scored]
        # chunks of rows (whole row blocks), each recomputed in backward: no [N, V] logits kept for autograd
        # kernels: whole 64-row tiles and 4x the logits per chunk (fewer, fuller head GEMMs on a GPU)
        block = exact_kernels.MM_BLOCK_M if self.triton else row_block(h.device)
        elements = CHUNK_ELEMENTS * (4 if self.triton else 1)
        chunk = max(1, elements // self.vocab_size // block) * block
        w = self._w(self.model.lm_head)[0].to(h.dtype)
        parts = [
            _maybe_checkpoint(
                self._chunk_logprobs, hs[i : i + chunk], w, targets[i : i + chunk], temperature, entropy
            )
            for i in range(0, hs.shape[0], chunk)
        ]
        lp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts]) if entropy else None
        out_lp = h.new_zeros((b, t), dtype=torch.float32)
        out_lp[:, 1:][scored[:, :-1]] = lp
        out_ent = None
        if ent is not None:
            out_ent = h.new_zeros((b, t), dtype=torch.float32)
            out_ent[:, 1:][scored[:, :-1]] = ent
        return out_lp[real], (out_ent[real] if out_ent is not None else None)
