"""`FamilyCache`: what the family caches (`ConceptCache`, `StreamCache`, `SegmentCache`) share — batch
operations over the state kept beside `self.layers`, byte counts, and an exact `crop`.

Legend: B batch, L tokens of one call, T tokens seen.

Rolling back. `generate` crops a cache after each verification pass of assisted decoding and prompt lookup
(and in the one-step-late stop check on MPS): the tokens a draft proposed and the model rejected must
leave no trace. Our caches keep state that is not stored per token (open chunks, pooled segments, rolling
windows), so slicing keys and values is not enough in general. Each cache therefore keeps a *rollback
point* — a cheap snapshot (`_snapshot`) of its state when it was created and after every `crop` — and a
`CallJournal`: the inputs of every call since then (token ids or embeddings, position ids, the attention
mask) and, weakly, the module that made them (the family's forward calls `record_call`). `crop(-n)`:

1. the cache's own shortcut, when it is exact (`_crop_in_place`: a `StreamCache` whose windows still
   hold what the kept tokens need just slices);
2. otherwise back to the rollback point (`_restore`) and the kept tokens of the journal fed again through
   the same module in one call. Exact by the families' contract: a forward over tokens [0, a) then
   [a, t) gives the same state as any other split of [0, t).

The crop point becomes the new rollback point, so transformers' pattern (a crop removes only tokens fed
since the previous crop) replays at most the tokens kept from one round. A crop to before the rollback
point, or after tokens were fed by something other than the family's forward (nothing recorded them),
raises. The journal holds 8 bytes per token and position (the embeddings when a call passed
`inputs_embeds`), cleared at every crop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache

# Recorded calls merged into one tensor at a time.
MERGE_CALLS = 64


class CallJournal:
    """The inputs of the calls since the rollback point, and the attention mask of every column seen.

    `mask` is (B, T) over every token since the cache was created (None while every call said "all
    real" by passing no mask); `tokens` and `positions` hold one (B, L, ...) / (B, L) tensor per call.
    """

    def __init__(self, mask: torch.Tensor | None = None) -> None:
        self.module: weakref.ref | None = None
        self.tokens: list[torch.Tensor] = []
        self.embedded = False
        self.positions: list[torch.Tensor | None] = []
        self.mask = mask
        self.count = 0
        self.unmerged = 0
        self.problem: str | None = None

    def record(
        self,
        module: torch.nn.Module,
        past_length: int,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> None:
        tokens = (input_ids if input_ids is not None else inputs_embeds).detach()
        if self.tokens and (input_ids is None) != self.embedded:
            self.problem = "its calls mixed input_ids and inputs_embeds"
        self.module, self.embedded = weakref.ref(module), input_ids is None
        self.tokens.append(tokens)
        self.positions.append(
            None if position_ids is None else position_ids.detach().expand(tokens.shape[0], -1)
        )
        self.count += tokens.shape[1]
        self.unmerged += 1
        if self.unmerged == MERGE_CALLS:
            # Decoding records one token per call: merge them, so a long generation keeps few tensors.
            self.tokens[-MERGE_CALLS:] = [torch.cat(self.tokens[-MERGE_CALLS:], dim=1)]
            positions = self.positions[-MERGE_CALLS:]
            merged = None if any(item is None for item in positions) else torch.cat(positions, dim=1)
            self.positions[-MERGE_CALLS:] = [merged]
            self.unmerged = 0
        self._extend_mask(attention_mask, past_length, tokens.shape[:2])

    def _extend_mask(self, attention_mask: torch.Tensor | None, past_length: int, shape: torch.Size) -> None:
        """Keep `mask` over every column (a call's mask covers past and new tokens, or the new ones)."""
        batch, length = shape
        if attention_mask is None:
            if self.mask is not None:
                self.mask = torch.cat([self.mask, self.mask.new_ones(batch, length)], dim=1)
        elif attention_mask.shape[-1] == past_length + length:
            self.mask = attention_mask.detach()
        elif attention_mask.shape[-1] == length:
            past = self.mask if self.mask is not None else attention_mask.new_ones(batch, past_length)
            self.mask = torch.cat([past, attention_mask.detach()], dim=1)
        else:
            self.problem = f"a call's attention_mask covered {attention_mask.shape[-1]} columns"

    def inputs(self, keep: int, start: int) -> dict[str, Any]:
        """Keyword arguments feeding the first `keep` recorded tokens again, after `start` earlier ones."""
        tokens = torch.cat(self.tokens, dim=1)[:, :keep]
        positions = None
        if all(position is not None for position in self.positions):
            positions = torch.cat(self.positions, dim=1)[:, :keep]
        return {
            "inputs_embeds" if self.embedded else "input_ids": tokens,
            "attention_mask": None if self.mask is None else self.mask[:, : start + keep],
            "position_ids": positions,
        }

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension `function` to every tensor (beam reordering, row selection)."""
        self.tokens = [function(tensor) for tensor in self.tokens]
        self.positions = [None if tensor is None else function(tensor) for tensor in self.positions]
        if self.mask is not None:
            self.mask = function(self.mask)


class FamilyCache(Cache):
    """A `Cache` with side state: batch operations cover it, and `crop` rolls it back exactly.

    Subclasses implement `_snapshot` / `_restore` (None stands for the empty cache) and extend
    `_apply_to_rows`; `_crop_in_place` is their optional shortcut.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clear_rollback()

    def _clear_rollback(self) -> None:
        self._journal = CallJournal()
        self._rollback: Any = None
        self._rollback_length = 0

    def reset(self) -> None:
        super().reset()
        self._clear_rollback()

    def record_call(
        self,
        module: torch.nn.Module,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> None:
        """Called by the family's forward before it feeds (B, L) tokens: what `crop` needs to replay them
        (`module` is called with the same keyword arguments and this cache)."""
        self._journal.record(
            module, self.get_seq_length(), input_ids, inputs_embeds, attention_mask, position_ids
        )

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers' convention: a negative count; 0 only
        makes the present state the rollback point)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"tokens_to_remove={tokens_to_remove}: {type(self).__name__}.crop takes a negative count "
                "of tokens to remove"
            )
        length = self.get_seq_length()
        target = length + tokens_to_remove
        if target < 0:
            raise ValueError(f"tokens_to_remove={tokens_to_remove}: the cache holds {length} tokens")
        if target < length and not self._crop_in_place(length - target):
            if target < self._rollback_length:
                raise ValueError(
                    f"tokens_to_remove={tokens_to_remove}: {type(self).__name__} can roll back to "
                    f"{self._rollback_length} tokens at most (its last crop), not to {target}"
                )
            self._replay(target)
        # Nothing before the new rollback point can be asked for again: drop what was kept for it.
        self._crop_in_place(0)
        self._rollback, self._rollback_length = self._snapshot(), target
        mask = self._journal.mask
        self._journal = CallJournal(None if mask is None else mask[:, :target])

    def _replay(self, target: int) -> None:
        """Back to the rollback point, then the journal's tokens up to `target` fed again (see above)."""
        journal, start = self._journal, self._rollback_length
        module = journal.module() if journal.module is not None else None
        problem = journal.problem
        if journal.count != self.get_seq_length() - start:
            problem = "tokens were fed without the family's forward recording them"
        elif target > start and module is None:
            problem = "the model that fed its tokens is gone"
        if problem is not None:
            raise ValueError(f"{type(self).__name__} cannot roll back to {target} tokens: {problem}")
        inputs = journal.inputs(target - start, start) if target > start else None
        self._restore(self._rollback)
        self._journal = CallJournal(None if journal.mask is None else journal.mask[:, :start])
        if inputs is not None:
            with torch.no_grad():
                module(**inputs, cache=self, use_cache=True)
        if self.get_seq_length() != target:
            raise RuntimeError(
                f"{type(self).__name__}: replaying gave {self.get_seq_length()} tokens, expected {target}"
            )

    def _snapshot(self) -> Any:
        """The state a later `_restore` returns to; must stay valid while the cache grows."""
        raise NotImplementedError

    def _restore(self, snapshot: Any) -> None:
        """Put the cache back to `snapshot` (None: empty)."""
        raise NotImplementedError

    def _crop_in_place(self, tokens: int) -> bool:
        """Remove the last `tokens` tokens exactly without replaying, if this cache can; True when done.
        With 0: drop what was kept only for a rollback (a window's entries beyond it)."""
        return False

    def _apply_to_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dimension `function` to every per-row tensor kept beside `self.layers` (the
        journal here; subclasses add their state and snapshot, calling this)."""
        self._journal.map(function)

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
