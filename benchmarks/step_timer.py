"""`StepTimer`: per-step wall times of `model.fit`, for the benchmarks.

Import it after the Keras backend is chosen (it imports keras).
"""

import time

import keras


class StepTimer(keras.callbacks.Callback):
    """Gaps between consecutive batch ends, in seconds (``gaps``).

    Each batch end reads the loss, so asynchronous dispatch cannot move a
    step's work into the next gap.
    """

    def on_train_begin(self, logs=None):
        self.last, self.gaps = None, []

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])
        now = time.perf_counter()
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
