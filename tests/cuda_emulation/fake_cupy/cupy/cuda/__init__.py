"""``cupy.cuda`` of the emulated device: one GPU, streams that run in order."""

from . import runtime  # noqa: F401


class Device:
    """The emulated device ``id`` (only 0 exists)."""

    def __init__(self, device=0):
        self.id = int(device)
        if self.id != 0:
            raise runtime.CUDARuntimeError(f"invalid device ordinal {self.id}")

    def use(self):
        pass

    def synchronize(self):
        pass

    @property
    def attributes(self):
        # Few multiprocessors: a cooperative launch runs a thread per block.
        return {"MultiProcessorCount": 4, "CooperativeLaunch": 1}

    @property
    def mem_info(self):
        return (16 << 30, 16 << 30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Stream:
    """Work runs at once on the host, so every stream is already in order."""

    null = None

    def __init__(self, non_blocking=False, ptr=0):
        self.ptr = ptr

    def synchronize(self):
        pass

    def use(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class ExternalStream(Stream):
    def __init__(self, ptr, device_id=-1):
        super().__init__(ptr=ptr)


Stream.null = Stream()


def get_current_stream():
    return Stream.null
