"""`relayrl merge-lora`: merge a LoRA adapter into its base model (relayrl.models.merge.merge_lora)."""

from __future__ import annotations

import argparse

from relayrl.config.command_line import error_boundary
from relayrl.models.loading import DTYPES
from relayrl.models.merge import merge_lora


def main(argv: list[str]) -> int:
    """`relayrl merge-lora ADAPTER_DIR OUT_DIR [--dtype fp32|bf16|fp16] [--base PATH] [--overwrite]`."""
    parser = argparse.ArgumentParser(prog="relayrl merge-lora", description=merge_lora.__doc__)
    parser.add_argument("adapter_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--base", default=None, help="base model folder or Hub id (default: the adapter's)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR (everything in it) when it is not empty; without it a non-empty OUT_DIR is refused",
    )
    args = parser.parse_args(argv)

    def go() -> int:
        out = merge_lora(
            args.adapter_dir, args.out_dir, dtype=args.dtype, base=args.base, overwrite=args.overwrite
        )
        print(f"merged model written to {out}")
        return 0

    return error_boundary("relayrl merge-lora", go)
