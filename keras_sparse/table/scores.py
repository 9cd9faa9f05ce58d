"""The valid range of a table's scores and of its LRU clock.

Both are int64. Each call moves the clock one step (an LRU score is the
step of the key's last call) or adds a call's occurrences to an LFU score,
and eviction marks the slots a call protects with the int64 maximum. Values
below ``SCORE_LIMIT`` (2**62) leave about 4.6e18 further steps or
sightings before that arithmetic could overflow; larger ones (a crafted
or corrupt record) would wrap scores or fail a later step.
"""

SCORE_LIMIT = 2**62


def check_scores(scores):
    """Raises ValueError (naming the range) unless every score is in
    ``[0, SCORE_LIMIT)``; ``scores``: flat int64, NumPy or CuPy."""
    if int(scores.shape[0]) == 0:
        return
    low, high = int(scores.min()), int(scores.max())
    if low < 0 or high >= SCORE_LIMIT:
        raise ValueError(
            f"import_: scores must be in [0, 2**62); got values from {low} to {high}"
        )
