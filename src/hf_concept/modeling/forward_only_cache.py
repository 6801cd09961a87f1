"""`ForwardOnlyCache`: the rules shared by caches whose per-row state cannot be rolled back.

`generate` may ask a cache to `crop` (assisted decoding, the one-step-late stop check on MPS); the concept
and stream caches keep state that is not stored per token (open chunks, rolling windows), so they declare
`is_croppable = False` and refuse every crop but the no-op one, naming what they cannot undo.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicCache


class ForwardOnlyCache(Cache):
    """A `Cache` that only grows; subclasses say why in `rollback_reason`."""

    rollback_reason = "its state is not kept per token"

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                f"tokens_to_remove={tokens_to_remove}: {type(self).__name__} cannot roll back "
                f"({self.rollback_reason})"
            )

    def _apply_to_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension `function` to every per-row tensor kept beside `self.layers`
        (subclasses with such state override this; the batch operations below call it)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._apply_to_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._apply_to_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._apply_to_rows(lambda tensor: tensor[indices.to(tensor.device)])

    def layer_bytes(self) -> int:
        """Bytes of the keys and values stored in `self.layers`."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += sum(tensor.numel() * tensor.element_size() for tensor in (layer.keys, layer.values))
        return total


def adopt_cache(
    past_key_values: Cache | None,
    own_type: type[Cache],
    new_cache: Callable[[], Cache],
    create: bool,
    family: str,
) -> Cache | None:
    """The family's own cache: `past_key_values` if it is one; a new one for None (when `create`) or for
    an empty plain `DynamicCache` (generate's default); anything else refused by name with the fix:
    static, offloaded and quantized caches (`cache_implementation=...` in generate) included, since
    replacing them would silently drop what the user asked of them."""
    if isinstance(past_key_values, own_type):
        return past_key_values
    if past_key_values is None:
        return new_cache() if create else None
    own, kind = own_type.__name__, type(past_key_values).__name__
    if getattr(past_key_values, "offloading", False):
        kind = f"offloaded {kind}"
    if type(past_key_values) is not DynamicCache or getattr(past_key_values, "offloading", False):
        raise ValueError(
            f"past_key_values of type {kind} is not supported: {family} decodes only with its own {own} "
            "(it keeps per-row state beside the keys and values); pass past_key_values="
            "model.model.new_cache(), or call generate() without cache_implementation (or with "
            "cache_implementation='dynamic')"
        )
    if past_key_values.get_seq_length() > 0:
        raise ValueError(
            f"past_key_values is a filled {type(past_key_values).__name__}; {family} can only continue "
            f"from a {own}"
        )
    return new_cache()


def cache_num_bytes(cache: Cache) -> int:
    """Bytes a cache holds: its own `num_bytes()` (our caches count their state too), else the keys and
    values of its layers (transformers' `DynamicCache` and friends)."""
    if hasattr(cache, "num_bytes"):
        return cache.num_bytes()
    if not isinstance(cache, Cache):
        raise ValueError(f"cache of type {type(cache).__name__} is not a transformers Cache")
    return ForwardOnlyCache.layer_bytes(cache)
