"""A synthetic language with known words, for testing that a segmenter finds word boundaries.

The dictionary is fixed by a seed: `num_words` words of `min_length`..`max_length` letters over an
alphabet of `alphabet_size` lowercase letters, prefix-free (no word begins another), so the end of a
word is decided by the letters read so far, which a causal router can see. Word frequencies are Zipfian
(weight 1 / rank^`zipf_exponent`). Text is words written one after another with no separator. With
`successors` > 0 the language has word-level context: after word w, the next word is drawn from w's own
`successors` preferred words (a fixed random choice per word, Zipfian among them) with probability
`context_share`, else from the global Zipfian distribution. Then the first letter of a word is only
predictable from the word before it, which is what a segment model's segment states carry.

`SyntheticWords.sample(num_words, rng)` returns the text and the positions (character offsets) where
words start; bytes and characters coincide (ASCII).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass


@dataclass(frozen=True)
class SyntheticText:
    """`text` and the offsets of its word starts (0 included)."""

    text: str
    word_starts: tuple[int, ...]

    @property
    def word_start_rate(self) -> float:
        """Share of characters that start a word: the boundary rate of a perfect word segmenter."""
        return len(self.word_starts) / max(len(self.text), 1)


class SyntheticWords:
    """A fixed prefix-free dictionary with Zipfian frequencies and optional word-level context."""

    def __init__(
        self,
        seed: int = 0,
        num_words: int = 64,
        alphabet_size: int = 12,
        min_length: int = 2,
        max_length: int = 6,
        zipf_exponent: float = 1.0,
        successors: int = 4,
        context_share: float = 0.8,
    ) -> None:
        if not 2 <= alphabet_size <= 26:
            raise ValueError(f"alphabet_size={alphabet_size!r} must be in [2, 26]")
        if not 1 <= min_length <= max_length:
            raise ValueError(f"min_length={min_length!r}, max_length={max_length!r}: need 1 <= min <= max")
        if not 0 <= context_share <= 1:
            raise ValueError(f"context_share={context_share!r} must be in [0, 1]")
        rng = random.Random(seed)
        self.words = _prefix_free_words(
            rng, num_words, string.ascii_lowercase[:alphabet_size], min_length, max_length
        )
        self.weights = [1.0 / (rank + 1) ** zipf_exponent for rank in range(num_words)]
        self.context_share = context_share if successors else 0.0
        self.successors = [rng.sample(range(num_words), min(successors, num_words)) for _ in range(num_words)]
        self.successor_weights = [
            1.0 / (rank + 1) ** zipf_exponent for rank in range(len(self.successors[0]))
        ]

    def next_word(self, previous: int | None, rng: random.Random) -> int:
        """Index of the word after `previous` (None: the first word of a text)."""
        if previous is not None and rng.random() < self.context_share:
            return rng.choices(self.successors[previous], self.successor_weights)[0]
        return rng.choices(range(len(self.words)), self.weights)[0]

    def sample(self, num_words: int, rng: random.Random) -> SyntheticText:
        """A text of `num_words` words and its word starts."""
        pieces, starts, offset, previous = [], [], 0, None
        for _ in range(num_words):
            previous = self.next_word(previous, rng)
            word = self.words[previous]
            starts.append(offset)
            pieces.append(word)
            offset += len(word)
        return SyntheticText("".join(pieces), tuple(starts))


def _prefix_free_words(
    rng: random.Random, count: int, alphabet: str, min_length: int, max_length: int
) -> list[str]:
    """`count` distinct words, none a prefix of another, in a random order (the order sets their rank)."""
    words: list[str] = []
    for _ in range(count * 1000):
        if len(words) == count:
            break
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_length, max_length)))
        if all(not (word.startswith(other) or other.startswith(word)) for other in words):
            words.append(word)
    if len(words) < count:
        raise ValueError(
            f"could not draw {count} prefix-free words of {min_length}-{max_length} letters over "
            f"{len(alphabet)} letters; allow longer words or a larger alphabet"
        )
    return words
