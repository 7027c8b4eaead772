"""The ranks of tests/distributed/test_hf_export.py's 2-rank test (a module of its own: torch.multiprocessing's
spawn imports the rank function by name in each child)."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.config.components import OptimConfig
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.distributed.hf_export import ExportStats
from relayrl.distributed.hf_export import export_hf as real_export_hf
from relayrl.models.tiny import build_tiny_tokenizer
from relayrl.training.setup import build_train_step
from relayrl.workers.role_state import RoleState


def untied_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A tiny Qwen2 whose LM head is NOT the embedding (as Qwen2.5-7B's), fp32, seeded."""
    tok = build_tiny_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def train_one_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ids = torch.randint(4, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _no_gather(*args, **kwargs):
    raise AssertionError("a weight was gathered: the export must write each rank's own rows")


def rank_main(rank: int, world: int, store: str, out: str) -> None:
    """Shard the untied model, train a step, export it as the policy does (RoleState.export) with every
    gathering collective patched to fail; then (outside the patch) gather the full weights for the parent to
    compare with the files, and save each rank's byte counts."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = untied_model()
        shard_model(model, ShardSpec(device=torch.device("cpu")))
        train = build_train_step(model, OptimConfig(lr=1e-2), 10, sharded=True)
        train_one_step(model, train.optimizer)
        state = RoleState(model, train, build_tiny_tokenizer(), full_weights=lambda p: {})
        stats: list[ExportStats] = []

        def export_hf(*args, **kwargs):
            stats.append(real_export_hf(*args, **kwargs))
            return stats[-1]

        with (
            mock.patch("relayrl.distributed.hf_export.export_hf", export_hf),
            mock.patch.object(dist, "all_gather_into_tensor", _no_gather),
            mock.patch.object(dist, "all_gather", _no_gather),
            mock.patch.object(dist, "gather", _no_gather),
            mock.patch("torch.distributed.tensor.DTensor.full_tensor", _no_gather),
        ):
            state.export(Path(out) / "export")
        (done,) = stats
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        full = {n: t.clone() for n, t in full_tensors(model)}
        torch.save(
            {"written": done.bytes_written, "local": local, "total": done.total_bytes, "full": full},
            Path(out) / f"rank_{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
