"""The synthetic language with known words: a prefix-free dictionary, word starts that match the
text, Zipfian frequencies and word-to-word context, all fixed by the seeds."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from hf_concept.data.synthetic_words import SyntheticWords


def test_dictionary_is_prefix_free_and_fixed_by_its_seed():
    language = SyntheticWords(seed=3)
    words = language.words
    assert len(set(words)) == len(words) == 64
    assert not any(a != b and b.startswith(a) for a in words for b in words)
    assert all(2 <= len(word) <= 6 and set(word) <= set("abcdefghijkl") for word in words)
    assert SyntheticWords(seed=3).words == words and SyntheticWords(seed=4).words != words


def test_word_starts_split_the_text_into_dictionary_words():
    language = SyntheticWords(seed=0)
    text = language.sample(200, random.Random(1))
    bounds = [*text.word_starts, len(text.text)]
    pieces = [text.text[a:b] for a, b in itertools.pairwise(bounds)]
    assert len(pieces) == 200 and all(piece in language.words for piece in pieces)
    # Prefix-free: reading left to right, a word ends exactly where a dictionary word is complete.
    starts, current = [0], ""
    for position, letter in enumerate(text.text):
        current += letter
        if current in language.words:
            starts.append(position + 1)
            current = ""
    assert tuple(starts[:-1]) == text.word_starts
    assert text.word_start_rate == pytest.approx(200 / len(text.text))


def test_frequencies_are_zipfian_and_words_follow_their_context():
    language = SyntheticWords(seed=0, successors=4, context_share=0.8)
    rng = random.Random(2)
    first = Counter(language.next_word(None, rng) for _ in range(20_000))
    # Rank 1 about twice rank 2 and three times rank 3 (weights 1, 1/2, 1/3).
    assert first[0] / first[1] == pytest.approx(2.0, rel=0.15) and first[0] / first[2] == pytest.approx(
        3.0, rel=0.15
    )
    after = Counter(language.next_word(5, rng) for _ in range(5_000))
    share = sum(after[word] for word in language.successors[5]) / 5_000
    assert share > 0.8  # 0.8 by context, plus the global draws that land there
    assert SyntheticWords(seed=0, successors=0).context_share == 0.0


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="alphabet_size=30"):
        SyntheticWords(alphabet_size=30)
    with pytest.raises(ValueError, match="prefix-free"):
        SyntheticWords(num_words=200, alphabet_size=2, max_length=3)
