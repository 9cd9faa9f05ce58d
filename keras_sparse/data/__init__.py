"""Input data helpers: synthetic Criteo-like data for examples and benchmarks."""

from keras_sparse.data.synthetic import criteo_like, zipf_ids

__all__ = ["criteo_like", "zipf_ids"]
