"""Dataset loading, templates, typed sample records, packing and token-budget batching.

loading.py    read rows from .json/.jsonl/.parquet/.csv files, folders, or Hub datasets
templates.py  prompt text (chat template / input_template / raw) and SFT loss masks (3 modes)
build.py      build_sft_data / build_prompt_data: held-out split, mixing, max_len drop, stats
records.py    RawRow, TokenizedSample, LoadStats
packing.py    packing / padding / token-budget micro-batches (trainers)
"""
