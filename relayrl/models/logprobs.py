"""Per-token log-probs and entropy without materialising the full [B, T, V] float32 logits.

    head_logprobs(hidden [B, T, H] | [N, H], weight [V, H], targets [B, T] | [N], *, bias=None,
                  temperature=1.0, chunk_size=None, with_entropy=False, ignore_index=-100)
        -> (logp [B, T] | [N] float32, entropy like logp or None)
    token_logprobs_from_logits(logits [..., V], targets [...], *, temperature=1.0, chunk_size=None,
                               with_entropy=False, ignore_index=-100) -> (logp, entropy | None)

Semantics (the same everywhere in relayrl): z = (hidden @ weight.T + bias) / temperature in float32,
logp_t = z[target_t] - logsumexp(z), entropy_t = logsumexp(z) - sum_v softmax(z)_v z_v, i.e. the
temperature-scaled distribution the rollout engine samples from. `targets[b, t]` is the token scored by
`hidden[b, t]`: the caller shifts (hidden[:, :-1] with input_ids[:, 1:]). Targets equal to `ignore_index`
get logp = 0 and no gradient; other targets must lie in [0, V). Outputs are float32 (float64 for float64
inputs). `from_logits` accepts -inf logits (banned tokens: p = 0, entropy and gradients stay finite).

Three levels, one path: this kernel (hidden states x LM head), relayrl.models.forward.token_logprobs (a
model over a list of token sequences, flat [N]), relayrl.workers.model_ops.row_logprobs (rows of a padded
SequenceBatch, [R, T]).

Memory. Tokens are processed in chunks of `chunk_size` rows (default: as many rows as fit 2**24 float32
logits = 64 MiB on CPU, i.e. 524 rows for V = 32k; 8x that on CUDA). Both functions are `torch.autograd.Function`s: the forward
keeps only the inputs and one float32 logsumexp (and entropy) per token; the backward recomputes each
chunk's logits, forms the logit gradient (onehot - p) * g_logp - p (log p + H) * g_ent for that chunk and
contracts it with weight / hidden immediately. Peak extra memory is therefore O(chunk_size * V), never
O(N * V). (`from_logits` necessarily returns a logits-sized gradient, in the logits' dtype.)
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 2**24


def _auto_chunk(chunk_size: int | None, vocab: int, device: torch.device) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(
                f"chunk_size must be >= 1 (got {chunk_size}); None picks one from the vocab size"
            )
        return chunk_size
    budget = CHUNK_ELEMENTS * (8 if device.type == "cuda" else 1)
    return max(1, budget // vocab)


def _fwd_chunk(
    z: Tensor, tgt: Tensor, valid: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """z [c, V] (already / temperature, owned by the caller) -> (logp [c], lse [c], entropy [c] | None)."""
    lse = torch.logsumexp(z, dim=-1)
    logp = (z.gather(1, tgt[:, None]).squeeze(1) - lse) * valid
    ent = None
    if with_entropy:
        p = torch.softmax(z, dim=-1)
        ent = lse - (p[:, None, :] @ z[:, :, None]).reshape(-1)  # sum_v p_v z_v without a [c, V] product
    return logp, lse, ent


def _bwd_chunk(
    z: Tensor,
    tgt: Tensor,
    valid: Tensor,
    lse: Tensor,
    ent: Tensor | None,
    g_logp: Tensor,
    g_ent: Tensor | None,
) -> Tensor:
    """Gradient w.r.t. z (the temperature-scaled logits) of sum(g_logp * logp + g_ent * entropy).

    Works in place on z (the caller's fresh chunk): two [c, V] buffers in total.
    """
    log_p = z.sub_(lse[:, None])
    p = log_p.exp()
    if g_ent is not None and ent is not None:
        # dH/dz_j = -p_j (log p_j + H)
        log_p.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])
    else:
        log_p = None
    g = g_logp * valid
    gz = p.mul_(-g[:, None])  # d logp_target / dz_j = [j = target] - p_j
    gz.scatter_add_(1, tgt[:, None], g[:, None])
    if log_p is not None:
        gz.add_(log_p)
    return gz


def _targets(targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    valid = targets != ignore_index
    return targets.masked_fill(~valid, 0).long(), valid.float()


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, ignore_index):
        tgt, valid = _targets(targets, ignore_index)
        n = hidden.shape[0]
        acc = _acc_dtype(weight.dtype)
        w_c = _compute_weight(weight, hidden.device)
        logp = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        ent = hidden.new_empty(n if with_entropy else 0, dtype=acc)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _head_logits(hidden[s:e], w_c, bias, temperature)
            lp, ls, en = _fwd_chunk(z, tgt[s:e], valid[s:e], with_entropy)
            logp[s:e], lse[s:e] = lp, ls
            if en is not None:
                ent[s:e] = en
            del z
        ctx.save_for_backward(hidden, weight, w_c if w_c is not weight else None, bias, tgt, valid, lse, ent)
        ctx.cfg = (temperature, chunk, with_entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):  # pyright: ignore[reportIncompatibleMethodOverride]
        hidden, weight, w_c, bias, tgt, valid, lse, ent = ctx.saved_tensors
        w_c = weight if w_c is None else w_c
        temperature, chunk, with_entropy = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_hidden = torch.zeros_like(hidden) if need_h else None
        # grad_w accumulates in the weight's dtype with addmm_ (fp32 inside the matmul, one rounding per
        # chunk): no param-sized fp32 buffer or temporary for a bf16 LM head (as Liger-Kernel's default)
        g_weight = torch.zeros_like(weight) if need_w else None
        g_bias = (
            torch.zeros_like(bias, dtype=_acc_dtype(bias.dtype)) if (need_b and bias is not None) else None
        )
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(lse.dtype)
        use_ent = with_entropy and g_ent is not None
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            z = _head_logits(hidden[s:e], w_c, bias, temperature)
            gz = _bwd_chunk(
                z,
                tgt[s:e],
                valid[s:e],
                lse[s:e],
                ent[s:e] if use_ent else None,
                g_logp[s:e],
                g_ent[s:e].to(lse.dtype) if use_ent and g_ent is not None else None,
            )
            del z
            if temperature != 1.0:
                gz.div_(temperature)
            gz_c = gz.to(w_c.dtype)
            if g_hidden is not None:
                g_hidden[s:e] = (gz_c @ w_c).to(hidden.dtype)
            if g_weight is not None and w_c is weight:
                g_weight.addmm_(gz_c.t(), hidden[s:e].to(weight.dtype))
            elif g_weight is not None:  # bf16 matmul (as autocast would), accumulated into the fp32 gradient
                g_weight.add_(gz_c.t() @ hidden[s:e].to(w_c.dtype))
            if g_bias is not None:
                g_bias += gz.sum(dim=0)
            del gz, gz_c  # free this chunk before the next one is formed
        g_bias = g_bias.to(bias.dtype) if g_bias is not None and bias is not None else None
        return g_hidden, g_weight, g_bias, None, None, None, None, None


def _finite(z: Tensor) -> Tensor:
    """In place: -inf logits (banned tokens) -> the most negative float, so p = 0 there and p * z = 0, not NaN."""
    return z.clamp_(min=torch.finfo(z.dtype).min)


def _check_targets(targets: Tensor, vocab: int, ignore_index: int) -> None:
    valid = targets[targets != ignore_index]
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
        raise ValueError(
            f"targets must be token ids in [0, {vocab}) or ignore_index={ignore_index}; got values in "
            f"[{int(valid.min())}, {int(valid.max())}]"
        )


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (exact tests); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_weight(weight: Tensor, device: torch.device) -> Tensor:
    """The LM head in the autocast dtype when CUDA autocast is on (cast once per call: the head matmuls then
    run in bf16 like every other matmul of the step, logits and their softmax stay float32), else itself."""
    if device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        if weight.dtype != dtype and weight.is_floating_point():
            return weight.to(dtype)
    return weight


def _head_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    z = h.to(weight.dtype) @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(_acc_dtype(z.dtype))
    return z.div_(temperature) if temperature != 1.0 else z


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    ignore_index: int = -100,
    check_targets: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `targets` (and entropy) under softmax((hidden @ weight.T + bias) / temperature), chunked.

    hidden [B, T, H] or [N, H]; weight [V, H] (the LM head); targets [B, T] or [N]. Returns float32 tensors
    shaped like targets. Differentiable w.r.t. hidden, weight and bias.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets {tuple(targets.shape)} must match hidden {tuple(hidden.shape)} without its last dim"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = {hidden.shape[-1]}, got {tuple(weight.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if check_targets:  # (reads the targets on the host: callers that checked them already skip the sync)
        _check_targets(targets, weight.shape[0], ignore_index)
    chunk = _auto_chunk(chunk_size, weight.shape[0], hidden.device)
    shape = targets.shape
    logp, ent = _HeadLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1),
        float(temperature),
        chunk,
        with_entropy,
        ignore_index,
    )
    return logp.reshape(shape), (ent.reshape(shape) if with_entropy else None)


class _LogitsLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, with_entropy, ignore_index):
        tgt, valid = _targets(targets, ignore_index)
        n = logits.shape[0]
        acc = _acc_dtype(logits.dtype)
        logp = logits.new_empty(n, dtype=acc)
        lse = logits.new_empty(n, dtype=acc)
        ent = logits.new_empty(n if with_entropy else 0, dtype=acc)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = _finite(logits[s:e].to(_acc_dtype(logits.dtype)) / temperature)
            lp, ls, en = _fwd_chunk(z, tgt[s:e], valid[s:e], with_entropy)
            logp[s:e], lse[s:e] = lp, ls
            if en is not None:
                ent[s:e] = en
        ctx.save_for_backward(logits, tgt, valid, lse, ent)
        ctx.cfg = (temperature, chunk, with_entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):  # pyright: ignore[reportIncompatibleMethodOverride]
        logits, tgt, valid, lse, ent = ctx.saved_tensors
        temperature, chunk, with_entropy = ctx.cfg
        g_logits = torch.empty_like(logits)
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(lse.dtype)
        use_ent = with_entropy and g_ent is not None
        for s in range(0, logits.shape[0], chunk):
            e = min(s + chunk, logits.shape[0])
            z = _finite(logits[s:e].to(_acc_dtype(logits.dtype)) / temperature)
            gz = _bwd_chunk(
                z,
                tgt[s:e],
                valid[s:e],
                lse[s:e],
                ent[s:e] if use_ent else None,
                g_logp[s:e],
                g_ent[s:e].to(lse.dtype) if use_ent and g_ent is not None else None,
            )
            g_logits[s:e] = gz.div_(temperature).to(logits.dtype)
            del gz
        return g_logits, None, None, None, None, None


def token_logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor | None]:
    """Like `head_logprobs` but from existing logits [..., V] (any float dtype, e.g. bf16): the float32
    upcast, softmax and its gradient are formed one chunk of rows at a time."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets {tuple(targets.shape)} must match logits {tuple(logits.shape)} without its last dim"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_targets(targets, logits.shape[-1], ignore_index)
    chunk = _auto_chunk(chunk_size, logits.shape[-1], logits.device)
    shape = targets.shape
    logp, ent = _LogitsLogprobs.apply(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        float(temperature),
        chunk,
        with_entropy,
        ignore_index,
    )
    return logp.reshape(shape), (ent.reshape(shape) if with_entropy else None)
