"""Our own forward over a Hugging Face decoder's modules, with an external preallocated KV cache.

`DecoderRunner` reads the policy's modules IN PLACE (embed_tokens, every layer's input/post-attention
RMSNorm, q/k/v/o projections, optional per-head q_norm/k_norm (Qwen3), MLP, final norm, lm_head): it calls
the same `nn.Module`s, so there is no copy and nothing to sync, and LoRA-wrapped projections work. Only
attention, rotary embedding and the cache are ours. Plain modules are evaluated by direct functional calls
over their own live parameters (same math, fewer kernels and no module-call overhead per decode step, which
dominates a small model on a CPU): HF RMSNorms by one `F.rms_norm`, `nn.Linear` by `F.linear`, the gated
SiLU MLP by three of them with the product in place; anything else (LoRA layers, other MLPs) is called:

    k_cache, v_cache: [layers, slots, kv_heads, max_len, head_dim] (model dtype)
    prefill(ids[B, T] right-padded, last[B], caches, slot_idx[M], row_idx[M]) -> logits[B, V] at last[b]
        causal SDPA over each padded row (flash on CUDA: padding is at the end, so a plain causal mask is
        right for the real tokens); row row_idx[m]'s K/V go to slot slot_idx[m] positions [0, T) (several
        slots may take the same row: the n samples of a prompt share one prefill).
    decode(tok[bs], pos[bs], caches, kv_len) -> logits[bs, V]
        slots [0, bs): writes K/V of `tok` at `pos` (one index_copy_ per layer and cache), attends over
        cache positions [0, kv_len) masked to <= pos. GQA without repeating K/V: the G query heads of a KV
        head ride as the query length, q[bs * kv_heads, G, D] x K[bs * kv_heads, kv_len, D] (sdpa: the
        same as 4-D SDPA; math, CPU's default: baddbmm with the scale and mask fused, softmax, bmm).
        Static shapes for fixed (bs, kv_len), so the caller can capture it in a CUDA graph.

Weights that do not train (an engine's own copy, a tensor-parallel shard) get fused q/k/v and gate/up
projections: one GEMM each, over buffers the parameters are views of (native_fused.py); a module that is not a
plain Linear (rollout/native_tp.py's row-parallel o_proj / down_proj, which all-reduce) is called as it is.

Supported: decoder-only models laid out like Llama (model.model.{embed_tokens, layers, norm, rotary_emb},
model.lm_head) with default or scaled rotary (the HF module's own inv_freq and attention_scaling are used)
and no active sliding window: model types in SUPPORTED_MODEL_TYPES. Others raise an error naming the type
and pointing at engine "hf".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from relayrl.rollout.kernels import decode_attention, rms_norm, rope_kv_write, silu_mul, silu_mul_ref
from relayrl.rollout.native_fused import fuse_projections, qkv_weights
from relayrl.rollout.native_moe import MOE_MODEL_TYPES, MoEForward, is_sparse_block, router_spec
from relayrl.rollout.native_ops import TensorFn, linear_fn, mlp_fn, norm_fn, norm_params, rope, want_kernels

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", *MOE_MODEL_TYPES)


class _Attention(Protocol):
    """The attention modules DecoderRunner reads (q_norm / k_norm: Qwen3 only, read with getattr)."""

    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    o_proj: torch.nn.Module
    q_norm: torch.nn.Module
    k_norm: torch.nn.Module


class _Layer(Protocol):
    self_attn: _Attention
    mlp: torch.nn.Module
    input_layernorm: torch.nn.Module
    post_attention_layernorm: torch.nn.Module


class _Rotary(Protocol):
    inv_freq: torch.Tensor


class _Body(Protocol):
    """`model.model` of a Llama-like HF decoder (the attributes `check_supported` checks)."""

    embed_tokens: torch.nn.Embedding
    layers: Sequence[_Layer]
    norm: torch.nn.Module
    rotary_emb: _Rotary


class _CausalLM(Protocol):
    """A Llama-like HF causal LM as DecoderRunner reads it; `config` is a transformers PretrainedConfig,
    whose fields (num_attention_heads, ...) are set per model type and so are untyped."""

    config: Any
    model: _Body
    lm_head: torch.nn.Module


class DecoderRunner:
    """Prefill and decode forwards over an HF causal LM's live modules (see module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_len: int,
        decode_attention: str = "auto",
        fuse: bool = True,
        kernels: bool | None = False,
    ) -> None:
        """`decode_attention`: "sdpa" (fused kernel), "math" (matmul + softmax; faster on CPU for short
        query groups) or "auto" (sdpa on CUDA, math elsewhere); `fuse`: lay out q/k/v and gate/up of weights
        that do not train as one buffer each and run one GEMM per group (native_fused.py); `kernels`: decode
        through the fused Triton kernels (kernels.py; None: on a CUDA device when triton imports)."""
        base = getattr(model, "get_base_model", None)
        if base is not None:  # peft: run the base model, whose projections carry the adapters
            model = base()
        if decode_attention not in ("auto", "sdpa", "math"):
            raise ValueError(f"decode_attention must be 'auto', 'sdpa' or 'math', got {decode_attention!r}")
        check_supported(model, max_len)
        lm = cast(_CausalLM, model)  # laid out as checked above
        cfg = lm.config
        self.model = lm
        self.body = lm.model
        self.layers = list(self.body.layers)
        self.n_heads: int = cfg.num_attention_heads
        self.n_kv: int = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.scale = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        self.vocab_size: int = cfg.vocab_size
        emb = self.body.embed_tokens.weight
        self.device, self.dtype = emb.device, emb.dtype
        self.max_len = max_len
        self.cos, self.sin = self._rope_table(max_len)
        self.kv_positions = torch.arange(max_len, device=self.device)
        self.kv_heads = torch.arange(self.n_kv, device=self.device)
        self.norms = [
            (norm_fn(layer.input_layernorm), norm_fn(layer.post_attention_layernorm)) for layer in self.layers
        ]
        self.final_norm = norm_fn(self.body.norm)
        self.projs = [
            tuple(linear_fn(getattr(layer.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            for layer in self.layers
        ]
        self.fused_layers = fuse_projections(model) if fuse else 0
        """Layers whose q/k/v and gate/up run as one GEMM each (native_fused.py: weights that do not train)."""
        self.qkv = [qkv_weights(layer.self_attn) for layer in self.layers]
        params = [norm_params(m) for layer in self.layers for m in (layer.input_layernorm,
                  layer.post_attention_layernorm)] + [norm_params(self.body.norm)]  # fmt: skip
        self.kernels = want_kernels(kernels, self.device, None not in params)
        """Decode runs the fused kernels (kernels.py: residual + RMSNorm, SiLU x up, rotary + KV write,
        attention over each slot's own length)."""
        self.norm_params = cast(list[tuple[torch.Tensor, float]], params)
        glu = silu_mul if self.kernels else silu_mul_ref
        self.mlps = [
            MoEForward(layer.mlp, router_spec(cfg), self.kernels)
            if is_sparse_block(layer.mlp)
            else mlp_fn(layer.mlp, glu)
            for layer in self.layers
        ]
        self.moe_layers = [li for li, fn in enumerate(self.mlps) if isinstance(fn, MoEForward)]
        """Layers with a sparse MoE block (native_moe.py): they run through `mlps` in every path."""
        self.routes: torch.Tensor | None = None
        """Routing replay's record, set by the engine: [slots, max_len + 1, len(moe_layers), k] int16, the
        experts each position's token was routed to (native_state.SlotState)."""
        self.qk_norms: list[tuple[TensorFn, TensorFn] | None] = [
            (norm_fn(layer.self_attn.q_norm), norm_fn(layer.self_attn.k_norm))
            if getattr(layer.self_attn, "q_norm", None) is not None
            else None
            for layer in self.layers
        ]
        if decode_attention == "auto":
            decode_attention = "sdpa" if self.device.type == "cuda" else "math"
        self.decode_attention = decode_attention

    def _rope_table(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_len, head_dim] as HF computes them (fp32, then cast to the model dtype), sin's first
        half negated (see rope)."""
        rot = self.body.rotary_emb
        inv_freq = rot.inv_freq.float().to(self.device)
        pos = torch.arange(max_len, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = float(getattr(rot, "attention_scaling", 1.0))
        cos, sin = (emb.cos() * scaling).to(self.dtype), (emb.sin() * scaling).to(self.dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # signed for rope's roll

    def cache_shape(self, slots: int) -> tuple[int, int, int, int, int]:
        """[layers, slots, kv_heads, max_len, head_dim]."""
        return (len(self.layers), slots, self.n_kv, self.max_len, self.head_dim)

    def _qkv(self, li: int, h: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """Project h [..., hidden] to q [..., H, D], k/v [..., Hkv, D] (with Qwen3's per-head norms); one GEMM
        when the layer's q/k/v are fused (native_fused.py)."""
        return self._heads(li, *self._project_qkv(li, h), shape)

    def _heads(
        self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        """Layer li's projected q [..., H * D], k/v [..., Hkv * D] as heads (with Qwen3's per-head norms)."""
        q = q.view(*shape, self.n_heads, self.head_dim)
        k = k.view(*shape, self.n_kv, self.head_dim)
        v = v.view(*shape, self.n_kv, self.head_dim)
        qk_norms = self.qk_norms[li]
        if qk_norms is not None:
            q_norm, k_norm = qk_norms
            q, k = q_norm(q), k_norm(k)
        return q, k, v

    def _project_qkv(self, li: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer li's q, k, v projections of h [..., hidden] (one GEMM when fused)."""
        fused = self.qkv[li]
        if fused is not None:
            weight, bias, sizes = fused
            q, k, v = F.linear(h, weight, bias).split(sizes, dim=-1)
            return q, k, v
        q_proj, k_proj, v_proj, _ = self.projs[li]
        return q_proj(h), k_proj(h), v_proj(h)

    def _o_proj(self, li: int, x: torch.Tensor) -> torch.Tensor:
        """Layer li's o_proj in prefill / extend (the module; decode calls projs[li][3], the same math)."""
        return self.layers[li].self_attn.o_proj(x)

    def _mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        """Layer li's MLP in prefill / extend: ours for a sparse block (the same routing as decode), else the
        module (decode calls mlps[li], the same math)."""
        fn = self.mlps[li]
        return fn(x) if isinstance(fn, MoEForward) else self.layers[li].mlp(x)

    def refresh_weights(self) -> None:
        """The weights changed (NativeEngine.load_weights): recompute what is derived from them. Nothing here
        (the modules are read live); rollout/fp8.py's FP8Runner re-quantises."""

    def _taken_routes(self, b: int, t: int) -> torch.Tensor:
        """The last forward's experts [b, t, MoE layers, k] int16 (each MoE layer's `last_idx`)."""
        idx = [cast(MoEForward, self.mlps[li]).last_idx for li in self.moe_layers]
        return torch.stack([i.view(b, t, -1) for i in idx if i is not None], dim=2).to(torch.int16)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.final_norm(x))

    def prefill(
        self,
        ids: torch.Tensor,
        last: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_idx: torch.Tensor,
        row_idx: torch.Tensor,
    ) -> torch.Tensor:
        """Run right-padded prompts ids [B, T]; fill slots; return logits [B, V] at positions last [B]."""
        b, t = ids.shape
        x = self.body.embed_tokens(ids)
        cos, sin = self.cos[None, None, :t], self.sin[None, None, :t]
        for li in range(len(self.layers)):
            norm1, norm2 = self.norms[li]
            q, k, v = self._qkv(li, norm1(x), (b, t))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k_cache[li, :, :, :t].index_copy_(0, slot_idx, k.index_select(0, row_idx))
            v_cache[li, :, :, :t].index_copy_(0, slot_idx, v.index_select(0, row_idx))
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.group > 1
            )
            x = x + self._o_proj(li, o.transpose(1, 2).reshape(b, t, -1))
            x = x + self._mlp(li, norm2(x))
        if self.routes is not None:
            self.routes[slot_idx, :t] = self._taken_routes(b, t)[row_idx]
        return self._logits(x[torch.arange(b, device=x.device), last])

    def extend(
        self,
        ids: torch.Tensor,
        start: list[int],
        lengths: list[int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: list[list[int]],
    ) -> torch.Tensor:
        """Prefill after a cached prefix: row b's tokens ids[b, :lengths[b]] (right-padded [B, T]) sit at
        positions start[b] + [0, lengths[b]) of slot slots[b][0], whose cache already holds valid K/V at
        [0, start[b]) (start 0: a fresh prompt). Writes their K/V there and into every other slot of
        slots[b] (the n samples of a fresh prompt) and attends over the first slot's cache [0, start[b] + i]
        for the token at offset i. Returns logits [B, V] at each row's last token. (Prefix caching: the next
        turn of a multi-turn episode, or a repeated prompt, prefills only what the slot does not hold yet;
        prefix_cache.py batches every request of a step into one call.) Offsets come from the host, so nothing
        here waits for the device; the attended length is rounded up to a multiple of 64 (fewer shapes)."""
        b, t = ids.shape
        d, hkv, n_layers, dev = self.head_dim, self.n_kv, len(self.layers), ids.device
        kv_len = min(self.max_len, -(-max(s + n for s, n in zip(start, lengths, strict=True)) // 64) * 64)
        # per (row, target slot) pair and real token, in [pair, Hkv, T] order: its row in k.reshape(-1, D) and
        # its row in the cache viewed as [layers, slots * Hkv * max_len, D] (padding is neither read nor
        # written); built on the host
        pairs = [(row, slot) for row, row_slots in enumerate(slots) for slot in row_slots]
        rows = torch.tensor([r for r, _ in pairs])[:, None, None]
        heads, toks = torch.arange(hkv)[None, :, None], torch.arange(t)
        real = (toks < torch.tensor(lengths)[rows]).expand(len(pairs), hkv, t)
        src = ((rows * hkv + heads) * t + toks).expand(len(pairs), hkv, t)[real]
        slot_rows = torch.tensor([s for _, s in pairs])[:, None, None] * hkv + heads
        dst = (slot_rows * self.max_len + torch.tensor(start)[rows] + toks)[real]
        src_t, dst_t = src.to(dev), dst.to(dev)
        start_t = torch.tensor(start, device=dev)
        slot_t = torch.tensor([row_slots[0] for row_slots in slots], device=dev)
        last = torch.tensor([n - 1 for n in lengths], device=dev)
        pos = (start_t[:, None] + torch.arange(t, device=dev)[None, :]).clamp(max=self.max_len - 1)  # [B, T]
        x = self.body.embed_tokens(ids)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, T, D]
        k_rows, v_rows = k_cache.view(n_layers, -1, d), v_cache.view(n_layers, -1, d)
        visible = self.kv_positions[None, None, :kv_len] <= pos[:, :, None]  # [B, T, kv_len]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
        for li in range(len(self.layers)):
            norm1, norm2 = self.norms[li]
            q, k, v = self._qkv(li, norm1(x), (b, t))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k_rows[li].index_copy_(0, dst_t, k.reshape(-1, d).index_select(0, src_t))
            v_rows[li].index_copy_(0, dst_t, v.reshape(-1, d).index_select(0, src_t))
            ks = k_cache[li, slot_t, :, :kv_len]  # [B, Hkv, kv_len, D] (gathered after the write)
            vs = v_cache[li, slot_t, :, :kv_len]
            o = F.scaled_dot_product_attention(
                q, ks, vs, attn_mask=mask[:, None], scale=self.scale, enable_gqa=self.group > 1
            )
            x = x + self._o_proj(li, o.transpose(1, 2).reshape(b, t, -1))
            x = x + self._mlp(li, norm2(x))
        if self.routes is not None:
            taken = self._taken_routes(b, t)
            for row, (s, n) in enumerate(zip(start, lengths, strict=True)):
                for slot in slots[row]:
                    self.routes[slot, s : s + n] = taken[row, :n]
        return self._logits(x[torch.arange(b, device=dev), last])

    def decode(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_len: int,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """One token for slots [0, bs) (rows = arange(bs)); returns logits [bs, V]."""
        if self.kernels:
            logits = self._decode_kernels(tok, pos, k_cache, v_cache, kv_len)
            if self.routes is not None:  # each slot's token at pos: its experts in every MoE layer
                self.routes[rows, pos] = self._taken_routes(tok.shape[0], 1)[:, 0]
            return logits
        bs, hkv, d = tok.shape[0], self.n_kv, self.head_dim
        x = self.body.embed_tokens(tok)  # [bs, hidden]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [bs, 1, D]
        # built once for all layers: where each new K/V row goes in the cache viewed as [layers, slots * Hkv *
        # max_len, D]; the attended K/V as [layers, bs * Hkv, kv_len, D] views; the mask
        dst = ((rows[:, None] * hkv + self.kv_heads) * self.max_len + pos[:, None]).view(-1)
        n_layers = len(self.layers)
        k_rows, v_rows = k_cache.view(n_layers, -1, d), v_cache.view(n_layers, -1, d)
        k_att = k_cache[:, :bs, :, :kv_len].view(n_layers, bs * hkv, kv_len, d)  # views (see the writes)
        v_att = v_cache[:, :bs, :, :kv_len].view(n_layers, bs * hkv, kv_len, d)
        mask = self._decode_mask(pos, kv_len)
        for li in range(n_layers):
            norm1, norm2 = self.norms[li]
            q, k, v = self._qkv(li, norm1(x), (bs,))
            qk = rope(torch.cat((q, k), dim=1), cos, sin)  # one rotary pass for q and k
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
            k_rows[li].index_copy_(0, dst, k.reshape(-1, d))
            v_rows[li].index_copy_(0, dst, v.reshape(-1, d))
            x = x + self.projs[li][3](self._attend(q, k_att[li], v_att[li], mask).view(bs, -1))
            x = x + self.mlps[li](norm2(x))
        if self.routes is not None:  # each slot's token at pos: its experts in every MoE layer
            self.routes[rows, pos] = self._taken_routes(bs, 1)[:, 0]
        return self._logits(x)

    def _decode_kernels(
        self, tok: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """`decode` through the fused kernels (kernels.py): the residual add rides in the next RMSNorm, rotary
        in the K/V write, attention reads each slot's positions [0, pos] only."""
        bs, norms = tok.shape[0], self.norm_params
        h, x = rms_norm(self.body.embed_tokens(tok), *norms[0])
        for li in range(len(self.layers)):
            q, k, v = self._qkv(li, h, (bs,))
            q = rope_kv_write(q, k, v, self.cos, self.sin, pos, k_cache[li], v_cache[li])
            o = decode_attention(q, k_cache[li], v_cache[li], pos, self.scale, kv_len)
            h, x = rms_norm(self.projs[li][3](o.view(bs, -1)), *norms[2 * li + 1], residual=x)
            h, x = rms_norm(self.mlps[li](h), *norms[2 * li + 2], residual=x)
        return self.model.lm_head(h)

    def _decode_mask(self, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Additive mask hiding cache positions > pos: [bs, 1, 1, T] in the model dtype for sdpa, [bs * Hkv,
        1, T] fp32 for math (baddbmm's bias over the G query heads of a KV head)."""
        hidden = self.kv_positions[None, None, None, :kv_len] > pos[:, None, None, None]
        if self.decode_attention == "sdpa":
            return torch.zeros(hidden.shape, dtype=self.dtype, device=hidden.device).masked_fill_(
                hidden, float("-inf")
            )
        mask = torch.zeros((pos.shape[0], self.n_kv, 1, kv_len), dtype=torch.float32, device=pos.device)
        return mask.masked_fill_(hidden, float("-inf")).view(-1, 1, kv_len)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [bs, H, D] over k/v [bs * Hkv, T, D] (the G = H / Hkv query heads of a KV head ride as the
        query length); returns [bs, H, D]."""
        bs, (n, t, d) = q.shape[0], k.shape
        if self.decode_attention == "sdpa":
            k, v = k.view(bs, n // bs, t, d), v.view(bs, n // bs, t, d)
            q4 = q.view(bs, n // bs, self.group, d)
            o = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=self.scale)
            return o.reshape(bs, -1, d)  # sdpa may return a transposed (non-contiguous) layout
        # math: 3-D batched matmuls over (slot, KV head), scale and mask fused into the first
        q3 = q.reshape(n, self.group, d)
        if q.dtype == torch.float32:
            probs = torch.softmax(torch.baddbmm(mask, q3, k.transpose(1, 2), alpha=self.scale), dim=-1)
        else:  # low precision: scale and mask in fp32, as the fp32 path
            scores = torch.bmm(q3, k.transpose(1, 2)).float() * self.scale + mask
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.bmm(probs, v).view(bs, -1, d)


def check_supported(model: torch.nn.Module, max_len: int) -> None:
    """Raise NotImplementedError naming the model type when the native forward cannot run it."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", type(model).__name__)
    hint = 'use the "hf" engine (build_engine("hf", ...)) for this model'
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"native rollout engine: model type {mtype!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); {hint}"
        )
    body = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(body, attr):
            raise NotImplementedError(f"native rollout engine: {mtype!r} model has no model.{attr}; {hint}")
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types or (mtype in ("mistral", "mixtral") and window is not None)
    if mtype == "qwen2" and not getattr(cfg, "use_sliding_window", False):
        sliding = False
    if sliding and window is not None and window < max_len:
        raise NotImplementedError(
            f"native rollout engine: {mtype!r} uses a sliding window of {window} < max_seq_len {max_len}; "
            f"lower max_seq_len to <= {window} or {hint}"
        )
