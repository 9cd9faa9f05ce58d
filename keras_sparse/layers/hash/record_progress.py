"""The progress bar's stages of each hash-layer record operation (export,
import, save, load) and their pace (`keras_sparse.progress`)."""

# Seconds each stage took at 10M keys on a CPU host: the bar's pace (only
# the ratios matter). The table's own import_ ("place") is one vectorized
# step, so the bar waits at its start until it ends.
EXPORT_STAGES = {"table": 1, "variables": 2, "gather": 2}
SAVE_STAGES = {**EXPORT_STAGES, "store": 2}
WRITE_STAGES = {"place": 25, "variables": 3, "write": 1, "assign": 0.5}
IMPORT_STAGES = {"check": 1.5, **WRITE_STAGES}
LOAD_STAGES = {"checkpoint": 1, "rows": 15, **WRITE_STAGES}
