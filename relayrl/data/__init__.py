"""Dataset loading, templates, typed sample records, packing and token-budget batching."""
