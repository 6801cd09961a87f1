"""How a family's forward takes the cache `generate` hands it (`adopt_cache`), and cache byte counts.

The family caches themselves derive from `family_cache.FamilyCache` (batch operations, exact `crop`).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers.cache_utils import Cache, DynamicCache

from .family_cache import FamilyCache


def adopt_cache(
    cache: Cache | None,
    own_type: type[Cache],
    new_cache: Callable[[], Cache],
    create: bool,
    family: str,
) -> Cache | None:
    """The family's own cache: `cache` if it is one; a new one for None (when `create`) or for
    an empty plain `DynamicCache` (generate's default); anything else refused by name with the fix:
    static, offloaded and quantized caches (`cache_implementation=...` in generate) included, since
    replacing them would silently drop what the user asked of them."""
    if isinstance(cache, own_type):
        return cache
    if cache is None:
        return new_cache() if create else None
    own, kind = own_type.__name__, type(cache).__name__
    if getattr(cache, "offloading", False):
        kind = f"offloaded {kind}"
    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        raise ValueError(
            f"cache of type {kind} is not supported: {family} decodes only with its own {own} "
            "(it keeps per-row state beside the keys and values); pass cache="
            "model.model.new_cache(), or call generate() without cache_implementation (or with "
            "cache_implementation='dynamic')"
        )
    if cache.get_seq_length() > 0:
        raise ValueError(f"cache is a filled {type(cache).__name__}; {family} can only continue from a {own}")
    return new_cache()


def cache_num_bytes(cache: Cache) -> int:
    """Bytes a cache holds: its own `num_bytes()` (our caches count their state too), else the keys and
    values of its layers (transformers' `DynamicCache` and friends)."""
    if hasattr(cache, "num_bytes"):
        return cache.num_bytes()
    if not isinstance(cache, Cache):
        raise ValueError(f"cache of type {type(cache).__name__} is not a transformers Cache")
    return FamilyCache.layer_bytes(cache)
