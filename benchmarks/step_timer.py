"""`StepTimer`: per-step wall times of `model.fit`, for the benchmarks.

Import it after the Keras backend is chosen (it imports keras).
"""

import time

import keras


class StepTimer(keras.callbacks.Callback):
    """Gaps between consecutive batch ends, in seconds (``gaps``), and
    the process CPU time of each gap (``cpu_gaps``: `time.process_time`,
    which other work on a busy machine disturbs less).

    Each batch end reads the loss, so asynchronous dispatch cannot move a
    step's work into the next gap.
    """

    def on_train_begin(self, logs=None):
        self.last, self.gaps = None, []
        self.last_cpu, self.cpu_gaps = None, []

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])
        now, cpu = time.perf_counter(), time.process_time()
        if self.last is not None:
            self.gaps.append(now - self.last)
            self.cpu_gaps.append(cpu - self.last_cpu)
        self.last, self.last_cpu = now, cpu
