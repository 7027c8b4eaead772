"""transformers' packed-row detection, skipped inside our own packed forwards.

Before it builds an attention mask, transformers (masking_utils._preprocess_mask_arguments) looks for several
sequences packed in one row: `find_packed_sequence_indices(position_ids)` ends in
`(packed_sequence_mask[:, -1] == 0).all()` read on the host, i.e. one device synchronisation per forward
(whenever position ids are given and there is no mask and no cache: every training forward). Its result only
feeds the mask function; inside relayrl.models.forward's varlen forward that function returns no mask at all
(attention runs per sequence from cu_seqlens), so the detection is pure cost there.

    skip_packed_detection(when)    once: transformers' function returns None while `when()` is true, and
                                   behaves as before otherwise (generate, plain model calls)

A transformers without the function is left alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from transformers import masking_utils


@functools.cache
def skip_packed_detection(when: Callable[[], bool]) -> None:
    """Make transformers' packed-row detection return None (no packed rows) while `when()` is true."""
    original: Any = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        return

    def find_packed_sequence_indices(position_ids: Any) -> Any:
        return None if when() else original(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
