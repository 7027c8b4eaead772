"""A reward model in this process: a value-head model scored in batches.

    rm = LocalRewardModel.from_pretrained("path/to/rm")      # AutoModelForSequenceClassification, num_labels=1
    rm.score_ids([[...], [...]])  -> [float, float]           # reward = head output at the last real token
    source = LocalRMSource(rm)                                # `await source.score(trajs)`

Scoring: sequences are right-padded into batches of `batch_size` (sorted by length to pad little); the
base model runs once per batch and the `score` head is read at each row's last non-pad position (from the
attention mask, so a pad id inside a sequence cannot move it): relayrl.models.value_head.sequence_scores,
the one value-head forward of padded rows. Right padding keeps position ids equal to
an unpadded run, so a sequence scores the same alone or in any batch. Models without a `score` head fall
back to their own pooled `logits`. Sequences longer than `max_len` keep their last `max_len` tokens.

`LocalRMSource` scores the trajectories' token ids directly when the reward model shares the policy's
tokenizer (`same_tokenizer=True`, default: token-exact, nothing re-tokenized); otherwise it re-tokenizes
`prompt + response` text with the reward model's tokenizer. The forward runs on a worker thread.
"""

from __future__ import annotations

from typing import Any

import torch

from relayrl.agents.base import Trajectory
from relayrl.agents.failures import FailureLog
from relayrl.agents.rewards.base import RewardBatch, chunks, fail_all, fill, pending
from relayrl.agents.user_code import run_in_thread
from relayrl.models.loading import load_pretrained, load_tokenizer, resolve_device
from relayrl.models.value_head import sequence_scores


class LocalRewardModel:
    """Batched scoring with a sequence-classification (value-head) model, num_labels = 1."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 16, max_len: int = 2048):
        labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if labels != 1:
            raise ValueError(f"reward model must have num_labels=1 (one score per sequence), it has {labels}")
        self.model = model.eval()
        self.tokenizer, self.batch_size, self.max_len = tokenizer, batch_size, max_len
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0))

    @classmethod
    def from_pretrained(
        cls, path: str, *, dtype: torch.dtype | None = None, device: str | None = None, **kwargs: Any
    ) -> LocalRewardModel:
        from transformers import AutoModelForSequenceClassification

        tokenizer = load_tokenizer(path)
        model = load_pretrained(
            AutoModelForSequenceClassification,
            path,
            what="reward model",
            device=resolve_device(device, "device"),
            num_labels=1,
            dtype=dtype,
        )
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        return cls(model, tokenizer, **kwargs)

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        """One reward per token-id sequence, in input order."""
        if any(len(s) == 0 for s in seqs):
            raise ValueError("cannot score an empty sequence")
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out = [0.0] * len(seqs)
        for idx in chunks(order, self.batch_size):
            values = self._forward([seqs[i][-self.max_len :] for i in idx])
            for i, v in zip(idx, values, strict=True):
                out[i] = v
        return out

    def score_texts(self, texts: list[str]) -> list[float]:
        """Tokenize (no special tokens added) and score."""
        return self.score_ids([list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts])

    def _forward(self, seqs: list[list[int]]) -> list[float]:
        device = next(self.model.parameters()).device
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        head = getattr(self.model, "score", None)
        base = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        if head is None or base is None:  # no `score` head: trust the model's own pooling
            return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
        return sequence_scores(self.model, ids, mask).tolist()


class LocalRMSource:
    """Reward source over a `LocalRewardModel` (see module doc)."""

    def __init__(
        self,
        rm: LocalRewardModel,
        *,
        same_tokenizer: bool = True,
        timeout: float | None = None,
        log: FailureLog | None = None,
    ) -> None:
        self.rm, self.same_tokenizer, self.timeout, self.log = rm, same_tokenizer, timeout, log
        self.name = "local RM"

    async def score(self, trajs: list[Trajectory]) -> None:
        todo = pending(trajs)
        if not todo:
            return
        try:
            if self.same_tokenizer:
                values = await run_in_thread(
                    self.rm.score_ids, [t.token_ids for t in todo], timeout=self.timeout
                )
            else:
                texts = [t.sample.prompt + t.response_text for t in todo]
                values = await run_in_thread(self.rm.score_texts, texts, timeout=self.timeout)
        except TimeoutError:
            return fail_all(todo, "timeout", f"no result within {self.timeout}s", self.name, self.log)
        except Exception as e:
            return fail_all(todo, "exception", f"raised {type(e).__name__}: {e}", self.name, self.log)
        fill(todo, RewardBatch(rewards=values), self.name, self.log)
