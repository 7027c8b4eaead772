"""`hf` engine: the reference, a thin wrapper over `transformers`' `model.generate`.

Slow but obviously right; tests compare the native engine against it and the benchmark uses it as the
baseline. Each round takes the waiting requests that share sampling settings (temperature, top_p, top_k,
stop tokens; a seeded request always runs alone so its seed alone decides its samples), expands every
prompt n times (one row per sample: no prefill sharing here), left-pads them and calls `generate` once.

Per row the generated tokens are cut at the first stop token (kept, STOP) or at the row's own length
limit min(max_new_tokens, max_seq_len - P) (LENGTH), so rows with different limits share one call.
Log-probs: log_softmax(raw_logits / T) of the sampled token from `output_logits` (T = 1 when greedy),
i.e. before top-p / top-k truncation, the protocol's semantics.

Vision-language models (docs/vlm.md): a request's `images` go to `generate` as pixel_values / image_grid_thw
(rows of one call concatenated in row order, a prompt's images repeated for each of its n rows). Image and
video placeholder tokens are suppressed (never sampled: one would claim an image that does not exist); the
recorded log-probs are then those of the distribution without them (a deviation like top-k truncation, tiny
for a trained model: TIS / ICEPOP correct it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from relayrl.rollout.base import Completion, FinishReason, SamplingParams
from relayrl.rollout.driver import Pending, ThreadedEngine, default_driver, load_named_tensors
from relayrl.rollout.media import ImageInputs, image_forward_inputs, vision_token_ids


def default_eos_ids(
    model: torch.nn.Module, tokenizer=None, eos_token_id: int | list[int] | None = None
) -> list[int]:
    """Stop ids that end every request: the explicit ones, else the tokenizer's EOS, else the model's."""
    ids = eos_token_id
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        gen_cfg = getattr(model, "generation_config", None)
        ids = getattr(gen_cfg, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in ([ids] if isinstance(ids, int) else ids)]


class HFEngine(ThreadedEngine):
    """`RolloutEngine` over `model.generate` (reference implementation, batches compatible requests)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        max_seq_len: int | None = None,
        max_batch: int = 64,
        eos_token_id: int | list[int] | None = None,
        driver: str | None = None,
    ) -> None:
        """`max_seq_len`: total (prompt + generated) length limit, default the model's
        max_position_embeddings; `max_batch`: most rows (samples) per `generate` call; `driver`: "thread" |
        "loop" (default: thread on CUDA, loop elsewhere; driver.py)."""
        super().__init__(name="hf", driver=driver or default_driver(next(model.parameters()).device))
        self.model = model
        self.max_seq_len = int(max_seq_len or getattr(model.config, "max_position_embeddings", 2048))
        self.max_batch = max_batch
        self.eos_ids = default_eos_ids(model, tokenizer, eos_token_id)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        self.vision_ids = vision_token_ids(model)
        self._waiting: list[Pending] = []
        self.generate_calls = 0
        """Number of `model.generate` calls made (for tests / logs)."""

    # ---- rounds ---------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._waiting)

    def _abort_inflight(self) -> None:
        waiting, self._waiting = self._waiting, []
        for p in waiting:
            p.abort()

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        if named_tensors is not None:
            load_named_tensors(self.model, named_tensors)

    def _step(self, new: list[Pending]) -> None:
        self._waiting.extend(p for p in new if not p.cancelled)
        self._waiting = [p for p in self._waiting if not p.cancelled]
        if not self._waiting:
            return
        group = self._take_group()
        try:
            self._run_group(group)
        except Exception as exc:
            for p in group:
                p.fail(exc)
            raise

    def _take_group(self) -> list[Pending]:
        """The oldest request plus later ones with the same settings, up to max_batch rows."""
        first = self._waiting[0]
        key = _group_key(first.request.params)
        group, rows, rest = [first], first.request.params.n, []
        for p in self._waiting[1:]:
            n = p.request.params.n
            if key is not None and _group_key(p.request.params) == key and rows + n <= self.max_batch:
                group.append(p)
                rows += n
            else:
                rest.append(p)
        self._waiting = rest
        return group

    def _run_group(self, group: list[Pending]) -> None:
        params = group[0].request.params
        done: dict[int, list[Completion]] = {}
        live: list[tuple[int, Pending, int]] = []  # (index in group, pending, length limit)
        for i, p in enumerate(group):
            limit = min(p.request.params.max_new_tokens, self.max_seq_len - len(p.request.prompt_ids))
            if limit <= 0:  # the prompt alone fills the length limit
                done[i] = [
                    Completion(token_ids=[], logprobs=[], finish_reason=FinishReason.LENGTH)
                ] * p.request.params.n
            else:
                live.append((i, p, limit))
        if live:
            rows = [
                (i, p.request.prompt_ids, limit) for i, p, limit in live for _ in range(p.request.params.n)
            ]
            images = ImageInputs.join(
                [p.request.images for _, p, _ in live for _ in range(p.request.params.n)]
            )
            for (i, _, _), comp in zip(rows, self._generate_rows(rows, params, images), strict=True):
                comp.versions = [self.version] * len(comp.token_ids)  # one round: one version
                done.setdefault(i, []).append(comp)
        for i, p in enumerate(group):
            p.finish(done[i])

    def _generate_rows(
        self,
        rows: list[tuple[int, list[int], int]],
        params: SamplingParams,
        images: ImageInputs | None = None,
    ) -> list[Completion]:
        device = next(self.model.parameters()).device
        width = max(len(ids) for _, ids, _ in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (_, ids, _) in enumerate(rows):
            input_ids[r, width - len(ids) :] = torch.tensor(ids)
            mask[r, width - len(ids) :] = 1
        stop = sorted(set(self.eos_ids) | set(params.stop_token_ids))
        kwargs = dict(
            max_new_tokens=max(limit for _, _, limit in rows),
            eos_token_id=stop or None,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            repetition_penalty=1.0,
        )
        temp = params.temperature if params.temperature > 0 else 1.0
        recorder = _LogprobRecorder(temp)
        kwargs["logits_processor"] = LogitsProcessorList([recorder])
        if params.temperature == 0:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(
                do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0)
            )
        inputs = dict(input_ids=input_ids.to(device), attention_mask=mask.to(device))
        inputs.update(image_forward_inputs(self.model, inputs["input_ids"], images))  # a VLM's rows' images
        if self.vision_ids:  # a VLM never samples an image placeholder (see module doc)
            kwargs["suppress_tokens"] = self.vision_ids
        generate = cast(Any, self.model).generate  # a transformers model (GenerationMixin)
        if params.seed is None:
            out = generate(**inputs, **kwargs)
        else:  # the seed alone decides the samples; the global RNG is left as it was
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(params.seed)
                out = generate(**inputs, **kwargs)
        self.generate_calls += 1
        gen = out.sequences[:, width:]
        lps = recorder.finish(gen[:, -1]).cpu()
        return [
            _cut(gen[r].tolist(), lps[r].tolist(), limit, set(stop)) for r, (_, _, limit) in enumerate(rows)
        ]


class _LogprobRecorder(LogitsProcessor):
    """Records log_softmax(raw_logits / T) of each chosen token, holding one [R, V] step at a time.

    Custom processors run before `generate`'s temperature / top-k / top-p warpers, so `scores` are the raw
    logits here. The token chosen from step t's scores is input_ids[:, -1] at step t + 1 (or the last
    generated token, for the final step: `finish`).
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.prev: torch.Tensor | None = None
        self.out: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride] (transformers' own stub: FloatTensor)
        if self.prev is not None:
            self.out.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[R, G] log-probs of every generated token, given the last generated token per row."""
        assert self.prev is not None, "finish before any generation step"
        self.out.append(self.prev.gather(-1, last_tokens[:, None]).squeeze(-1))
        self.prev = None
        return torch.stack(self.out, dim=1)


def _group_key(params: SamplingParams) -> tuple | None:
    """Requests with equal keys share one `generate` call; seeded requests (None) run alone."""
    if params.seed is not None:
        return None
    return (params.temperature, params.top_p, max(params.top_k, 0), tuple(params.stop_token_ids))


def _cut(tokens: list[int], logprobs: list[float], limit: int, stop: set[int]) -> Completion:
    """Cut a generated row at its first stop token (STOP) or at `limit` tokens (LENGTH)."""
    for j, tok in enumerate(tokens[:limit]):
        if tok in stop:
            return Completion(
                token_ids=tokens[: j + 1], logprobs=logprobs[: j + 1], finish_reason=FinishReason.STOP
            )
    return Completion(token_ids=tokens[:limit], logprobs=logprobs[:limit], finish_reason=FinishReason.LENGTH)
