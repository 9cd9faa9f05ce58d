"""Input data helpers: synthetic Criteo-like data for examples and benchmarks,
the asynchronous prefetching input stage (`prefetch`), and a planner of
remote rows cached on the devices that read them (`plan_remote_cache`)."""

# Imported last: binds `keras_sparse.data.prefetch` to the function (the
# module stays importable as `keras_sparse.data.prefetch` via sys.modules).
from keras_sparse.data.prefetch import PrefetchError  # noqa: E402
from keras_sparse.data.prefetch import PrefetchStage  # noqa: E402
from keras_sparse.data.prefetch import prefetch  # noqa: E402
from keras_sparse.data.remote_cache import plan_remote_cache  # noqa: E402
from keras_sparse.data.routing import locality_assignment  # noqa: E402
from keras_sparse.data.synthetic import criteo_like
from keras_sparse.data.synthetic import zipf_ids

__all__ = [
    "PrefetchError",
    "PrefetchStage",
    "criteo_like",
    "locality_assignment",
    "plan_remote_cache",
    "prefetch",
    "zipf_ids",
]
