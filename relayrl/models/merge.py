"""Merge a saved LoRA adapter into its base model: `merge_lora(adapter_dir, out_dir)` -> a full HF folder.

Above both loading.py (sources, tokenizers, dtypes) and value_head.py (a reward model's statistics): a
value-head adapter (peft task SEQ_CLS) merges into an AutoModelForSequenceClassification, a causal-LM adapter
into an AutoModelForCausalLM. The command is `relayrl merge-lora` (relayrl/apps/merge_lora.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from relayrl.models.loading import load_tokenizer, resolve_source, torch_dtype
from relayrl.models.value_head import reward_stats, write_reward_stats


def check_merge_output(out_dir: Path, inputs: dict[str, Path], *, overwrite: bool) -> None:
    """Refuse an output folder that is one of the inputs (`inputs`: what -> folder), always, and a folder that
    already holds something (another model), unless `overwrite`."""
    out = out_dir.expanduser().resolve()
    for what, path in inputs.items():
        if path.expanduser().resolve() == out:
            raise ValueError(
                f"the output folder {out_dir} is the {what}; write the merged model to another folder"
            )
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"the output {out_dir} is a file, not a folder; choose another OUT_DIR")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        held = sorted(p.name for p in out_dir.iterdir())
        raise ValueError(
            f"the output folder {out_dir} is not empty ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}); "
            "choose an empty or new folder, or pass --overwrite to replace it (everything in it)"
        )


def _replace_folder(tmp: Path, out_dir: Path) -> None:
    """Move the finished `tmp` folder to `out_dir`, replacing what was there (only after the write succeeded)."""
    if out_dir.exists():
        trash = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
        out_dir.rename(trash)
        tmp.rename(out_dir)
        shutil.rmtree(trash)
    else:
        tmp.rename(out_dir)


def merge_lora(
    adapter_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "fp32",
    base: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Merge a saved LoRA adapter folder into its base model and save a full HF folder (+ tokenizer).

    The base model is `base` when given, else the adapter's `base_model_name_or_path`; a local base that does
    not exist is an error before anything loads (with the flag to pass). The tokenizer is copied from the
    adapter folder when present, else from the base. A value-head adapter (peft task SEQ_CLS: a reward model
    or critic trained with LoRA) merges into an AutoModelForSequenceClassification with its trained `score`
    head, and a reward model's reward_mean / reward_std go into the merged config.json.

    `out_dir` must not be the adapter or base folder, and must be empty or new unless `overwrite` (then it is
    replaced as a whole); checked before anything loads. The model is written to a temporary sibling folder
    and moved into place when complete, so a failed merge leaves `out_dir` as it was.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    adapter_path, out_dir = Path(adapter_path), Path(out_dir)
    config = adapter_path / "adapter_config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{adapter_path} has no adapter_config.json: is it a LoRA adapter folder?")
    adapter = json.loads(config.read_text())
    named = adapter.get("base_model_name_or_path") or ""
    value_head = adapter.get("task_type") == "SEQ_CLS"
    source = base or named
    try:
        source = resolve_source(source, "the adapter's base model")
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{e} (named in {config}{', run from ' + str(Path.cwd()) if not Path(source).is_absolute() else ''}); "
            "pass the base model folder with --base PATH"
        ) from None
    inputs = {"adapter folder": adapter_path}
    if Path(source).exists():
        inputs["base model folder"] = Path(source)
    check_merge_output(out_dir, inputs, overwrite=overwrite)
    tok_source = adapter_path if (adapter_path / "tokenizer_config.json").is_file() else source
    tokenizer = load_tokenizer(str(tok_source))
    if value_head:
        base_model = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=1, dtype=torch_dtype(dtype), pad_token_id=tokenizer.pad_token_id
        )
    else:
        base_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype))
    model = PeftModel.from_pretrained(base_model, adapter_path)
    merged = model.merge_and_unload()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.merging-", dir=out_dir.parent))
    try:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stats = reward_stats(adapter_path)
        if stats is not None:
            write_reward_stats(tmp, *stats)
        _replace_folder(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir
