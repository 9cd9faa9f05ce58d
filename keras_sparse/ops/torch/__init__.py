"""PyTorch ops: the lookup primitive (`lookup`), its row updates and the
DistributedDataParallel helpers."""
