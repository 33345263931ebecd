"""Diversity of generated responses: is the synthetic training set varied, or a single refrain?"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def _ngrams(ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


def diversity(responses: Sequence[Sequence[int]], finished: Sequence[bool] | None = None) -> dict[str, float]:
    """Length statistics (tokens), distinct-2 over the whole set, the mean within-response 4-gram
    repetition rate, the share of empty responses and of responses cut at the token limit."""
    lengths = [len(r) for r in responses]
    bigrams = [g for r in responses for g in _ngrams(r, 2)]
    repeats = []
    for r in responses:
        grams = _ngrams(r, 4)
        if grams:
            repeats.append(1 - len(set(grams)) / len(grams))
    return {
        "responses": len(responses),
        "length_mean": statistics.fmean(lengths) if lengths else 0.0,
        "length_std": statistics.pstdev(lengths) if lengths else 0.0,
        "length_min": min(lengths, default=0),
        "length_max": max(lengths, default=0),
        "distinct_2": len(set(bigrams)) / len(bigrams) if bigrams else 0.0,
        "repetition_rate": statistics.fmean(repeats) if repeats else 0.0,
        "empty_fraction": sum(n == 0 for n in lengths) / len(lengths) if lengths else 0.0,
        "truncated_fraction": (sum(not f for f in finished) / len(finished)) if finished else 0.0,
    }
