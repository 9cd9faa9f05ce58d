"""Synthetic Criteo-like click data with a learnable hidden model.

The generator is fully vectorized NumPy. Categorical ids follow a bounded Zipf
law, like real click logs where a few ids carry most of the traffic. Labels come
from a fixed hidden logistic model, so data drawn with different seeds (a train
and a test set, say) share the same ground truth and a DLRM trained on one
generalizes to the other.

Example:

>>> from keras_sparse.data import criteo_like
>>> features, labels = criteo_like(1000, scale=0.001, seed=0)
>>> features["dense"].shape, features["cat_0"].shape, labels.shape
((1000, 13), (1000,), (1000, 1))
>>> sorted(features)[:3]
['cat_0', 'cat_1', 'cat_10']
"""

import math

import numpy as np

# Per-field vocabulary sizes of the Criteo Kaggle display-advertising log.
CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
    3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
    142572,
)  # fmt: skip

# Smallest vocabulary `scale` shrinks a field to, so that tiny fields survive.
_MIN_SCALED_CARDINALITY = 16

# The hidden model is fixed (independent of `seed`) so separate draws share it.
_HIDDEN_MODEL_SEED = 20240611
_GOLDEN = 0.6180339887498949

# Salts that make the per-id hashes of different hidden-model terms independent.
_SALT_EFFECT = 0x5851F42D4C957F2D
_SALT_LATENT = 0x14057B7EF767814F
_SALT_KEY = 0x2545F4914F6CDD1D

# (field, weight) pairs: per-id random effects. Weights favor low- and
# mid-cardinality fields, whose ids recur often enough to be learned.
_EFFECT_FIELDS = ((0, 0.5), (1, 0.4), (4, 0.4), (5, 0.5), (7, 0.3), (9, 0.3),
                  (10, 0.3), (13, 0.4), (2, 0.3), (3, 0.2), (11, 0.2))  # fmt: skip
# (field_a, field_b, weight): low-rank id x id interactions, which the dot
# interaction of a DLRM is built to capture.
_PAIR_FIELDS = ((0, 1, 0.6), (4, 5, 0.6), (6, 9, 0.4))
_LATENT_DIM = 4
_DENSE_WEIGHT_STD = 0.35
# Shifts the base rate to roughly Criteo's ~25% positives.
_BIAS = -1.6


def zipf_ids(n, cardinality, a, rng):
    """Draws `n` ids in `[0, cardinality)` from a bounded Zipf law.

    Rank `r` (1-based) has probability proportional to `r ** -a`. Sampling is by
    inverse CDF: `np.searchsorted` of uniforms into the cumulative weights. Ranks
    then go through a fixed bijection (an affine map modulo `cardinality` that
    depends only on `cardinality`), so the hot ids are spread over the range yet
    identical across calls, seeds and splits.

    Args:
        n: number of ids to draw.
        cardinality: vocabulary size; ids lie in `[0, cardinality)`.
        a: Zipf exponent (> 0); larger is more skewed.
        rng: a `numpy.random.Generator`.

    Returns:
        int64 array of shape `[n]`.

    Example:

    >>> import numpy as np
    >>> ids = zipf_ids(100_000, 1_000_000, 1.05, np.random.default_rng(0))
    >>> bool(ids.min() >= 0 and ids.max() < 1_000_000)
    True
    >>> int(np.bincount(ids).max()) > 100  # a hot id
    True
    """
    if cardinality < 1:
        raise ValueError(f"cardinality must be >= 1, got {cardinality}")
    if cardinality == 1:
        return np.zeros(n, dtype=np.int64)
    cdf = np.cumsum(np.arange(1, cardinality + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(n), side="right")
    # Rounding in the cumulative sum can leave cdf[-1] a hair below a uniform.
    np.minimum(ranks, cardinality - 1, out=ranks)
    multiplier, offset = _rank_bijection(cardinality)
    return (ranks.astype(np.int64) * multiplier + offset) % cardinality


def criteo_like(
    num_samples,
    *,
    num_dense=13,
    cardinalities=None,
    scale=1.0,
    zipf_a=1.05,
    hashed_keys=False,
    seed=0,
):
    """Generates Criteo-like features and click labels.

    Args:
        num_samples: number of rows.
        num_dense: number of dense (count-like) features.
        cardinalities: vocabulary size per categorical field; defaults to the
            26 fields of the Criteo Kaggle log (3 to ~10M ids).
        scale: multiplies every cardinality (fields never shrink below 16 ids
            or grow); e.g. `0.01` caps the largest field at ~100k ids for CI.
        zipf_a: Zipf exponent of the id distribution of each field.
        hashed_keys: if True, categorical values are random-looking int64 keys,
            a bijective mix of `(field, id)` (unique across fields), for
            dynamic-vocabulary layers; else dense ids in `[0, cardinality)`.
        seed: seed of the sample draw. The hidden model does not depend on it.

    Returns:
        `(features, labels)`: `features` maps `"dense"` to float32
        `[num_samples, num_dense]` (log-transformed counts, as usually fed to
        DLRM) and `"cat_0"`... to `[num_samples]` int32 ids (int64 keys if
        `hashed_keys`); `labels` is float32 `[num_samples, 1]` of 0/1.

    Example:

    >>> features, labels = criteo_like(2000, scale=0.001, hashed_keys=True)
    >>> features["cat_3"].dtype, labels.dtype
    (dtype('int64'), dtype('float32'))
    >>> 0.1 < float(labels.mean()) < 0.45
    True
    """
    cardinalities = scaled_cardinalities(cardinalities, scale)
    rng = np.random.default_rng(seed)
    hidden_rng = np.random.default_rng(_HIDDEN_MODEL_SEED)

    latent = rng.standard_normal((num_samples, num_dense))
    dense = np.log1p(np.floor(np.exp(1.2 * latent + 1.5))).astype(np.float32)
    dense_weights = hidden_rng.normal(0.0, _DENSE_WEIGHT_STD, num_dense)
    logits = _BIAS + latent @ dense_weights

    ids = [zipf_ids(num_samples, c, zipf_a, rng) for c in cardinalities]
    for field, weight in _EFFECT_FIELDS:
        if field < len(ids):
            logits += weight * _hash_normal(field, ids[field], _SALT_EFFECT)
    for field_a, field_b, weight in _PAIR_FIELDS:
        if max(field_a, field_b) < len(ids):
            dot = sum(
                _hash_normal(field_a, ids[field_a], _SALT_LATENT + k)
                * _hash_normal(field_b, ids[field_b], _SALT_LATENT + k)
                for k in range(_LATENT_DIM)
            )
            logits += weight * dot / math.sqrt(_LATENT_DIM)
    # A dense x categorical interaction, so the MLPs have something to mix.
    if len(ids) > 5:
        logits += 0.4 * latent[:, 0] * _hash_normal(5, ids[5], _SALT_EFFECT + 1)

    labels = (rng.random(num_samples) < _sigmoid(logits)).astype(np.float32)
    features = {"dense": dense}
    for field, field_ids in enumerate(ids):
        if hashed_keys:
            features[f"cat_{field}"] = hashed_key(field, field_ids)
        else:
            features[f"cat_{field}"] = field_ids.astype(np.int32)
    return features, labels[:, None]


def scaled_cardinalities(cardinalities=None, scale=1.0):
    """Returns the per-field vocabulary sizes `criteo_like` uses for `scale`."""
    cardinalities = CRITEO_CARDINALITIES if cardinalities is None else cardinalities
    scaled = [
        min(c, max(_MIN_SCALED_CARDINALITY, round(c * scale))) for c in cardinalities
    ]
    if max(scaled) >= 2**31:
        raise ValueError("cardinalities must be below 2**31 (ids are int32)")
    return scaled


def hashed_key(field, ids):
    """Maps `(field, id)` to an int64 key; bijective, so keys never collide."""
    packed = (np.uint64(field) << np.uint64(40)) | ids.astype(np.uint64)
    return _splitmix64(packed ^ np.uint64(_SALT_KEY)).view(np.int64)


def _rank_bijection(cardinality):
    # A multiplier coprime with the cardinality makes rank -> id a bijection.
    multiplier = int(cardinality * _GOLDEN) | 1
    while math.gcd(multiplier, cardinality) != 1:
        multiplier += 2
    return multiplier, int(cardinality * (1.0 - _GOLDEN))


def _splitmix64(x):
    """The splitmix64 finalizer: a bijective, well-mixing map on uint64."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash_normal(field, ids, salt):
    """A fixed pseudo-random value per `(field, id)`, mean 0 and variance 1.

    Hashing instead of storing a table keeps the hidden model free of per-id
    state, however large the vocabulary.
    """
    packed = (np.uint64(field) << np.uint64(40)) | ids.astype(np.uint64)
    bits = _splitmix64(packed ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF))
    uniform = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53
    # Uniform on [-sqrt(3), sqrt(3)) has unit variance.
    return (uniform - 0.5) * (2.0 * math.sqrt(3.0))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))
