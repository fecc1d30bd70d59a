"""Data: document sources -> tokenized, packed, SP-sliced, resumable batches (see docs/data.md)."""
from lingua_zeco.data.loader import DataArgs, PackedDataLoader, build_data_loader

__all__ = ["DataArgs", "PackedDataLoader", "build_data_loader"]
