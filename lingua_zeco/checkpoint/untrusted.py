"""Reading a checkpoint folder someone else may have written, without running code from it.

A checkpoint is a folder of pickles, and unpickling runs whatever callables the stream names. Checksums do
not help: they live in the same folder, so whoever changes a file can re-hash it. So every pickle this
package reads goes through an unpickler that constructs only the types its writer puts there:

* `extra.pt`, `rank{r}.pt` (our train state: ints, floats, strings, tuples, dicts, tensors) and DCP's
  non-tensor entries (optimizer hyperparameters): torch's weights-only unpickler.
* DCP's `.metadata` (pickled by DCP itself, read with a full `pickle.load` by its FileSystemReader):
  `MetadataUnpickler`, which admits the metadata dataclasses, torch.Size, dtypes, layouts and paths only.
* DCP's tensor shards are already read weights-only by DCP.

Anything else raises UntrustedCheckpointError, one line naming the file and the type refused; so does a file
that is no regular file (a link, a pipe, a device) and a shard path in `.metadata` that is not a bare name of
the folder: nothing outside the checkpoint's folder is read.
"""
from __future__ import annotations

import io
import os
import pickle
import re

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from lingua_zeco.args import ConfigError

from .integrity import in_folder, regular_file

_META = "torch.distributed.checkpoint.metadata"
# (module, name) pairs DCP's metadata pickle names (as torch 2.13 writes it; TensorProperties and its memory
# format enum also where older torch kept them), and nothing reachable from them by a dotted name: find_class
# resolves "os.system" inside any module that imports os.
METADATA_GLOBALS = frozenset(
    {(_META, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                          "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    | {("torch.distributed._shard.sharded_tensor.metadata", n) for n in ("TensorProperties", "MEM_FORMAT_ENCODING")}
    | {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    | {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)})


class UntrustedCheckpointError(ConfigError):
    """A checkpoint file holds a type its writer never puts there: refused, never unpickled. A ConfigError,
    not damage: falling back to an older checkpoint of a tampered folder would hide it."""


def _refusal(path: str, what: str, why: str = "unpickling it could run code") -> UntrustedCheckpointError:
    return UntrustedCheckpointError(f"{path} holds {what}, which a checkpoint never holds: refused without "
                                    f"loading it ({why}); use checkpoints you wrote, or an HF export "
                                    f"(safetensors and JSON)")


def check_regular(folder: str, names) -> None:
    """Every existing entry `names` of `folder` is a regular file (integrity.regular_file), else refused."""
    for name in sorted(names):
        path = os.path.join(folder, name)
        if os.path.lexists(path) and not regular_file(path):
            raise UntrustedCheckpointError(f"{path} is a link, a pipe or a device, which a checkpoint never holds: "
                                           f"refused without reading it (nothing outside the folder is read, and "
                                           f"a pipe would block the reader); copy the file itself into the folder")


def load_file(path: str):
    """One of our own checkpoint files (extra.pt, rank{r}.pt), weights-only: tensors and plain values."""
    check_regular(os.path.dirname(path), [os.path.basename(path)])
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise weights_only_refusal(path, e) from e


def weights_only_refusal(where: str, e: pickle.UnpicklingError) -> UntrustedCheckpointError:
    """torch's weights-only unpickler refused something in `where`: the one line naming it (torch names the
    global it refused inside a page of advice)."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    return _refusal(where, found.group(1) if found else "an object other than tensors and plain values")


def _weights_only_bytes(value: io.BytesIO, where: str) -> io.BytesIO:
    """`value` (a torch.save stream) re-saved from its weights-only load: only safe types are left in it."""
    try:
        obj = torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refusal(where, "a non-tensor entry that is not a plain value") from e
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that constructs only METADATA_GLOBALS; `path` names the file in the refusal."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise _refusal(self.path, f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid):  # DCP's metadata has no persistent ids; a reference to outside state
        raise _refusal(self.path, "a persistent id")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader with its metadata read by MetadataUnpickler instead of `pickle.load`."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")  # per-rank metadata files (DCP without collectives); the trainer writes one
        folder = str(self.path)
        path = os.path.join(folder, ".metadata" if rank is None else f"__{rank}.metadata")
        check_regular(folder, [os.path.basename(path)])
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
        shards = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
        for name in sorted(shards, key=str):  # DCP opens folder/name: an absolute name or "../" leads elsewhere
            if in_folder(folder, name) is None:
                raise _refusal(path, f"the shard path {name!r}, which is not a file of its folder",
                               "nothing outside the folder is read")
        check_regular(folder, shards)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, whose non-tensor entries (DCP unpickles them in full) are loaded weights-only
    first; what passes is plain data, which the full unpickle then cannot turn into code."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        where = f"{self.path} (entry {read_item.dest_index.fqn})"
        super().load_bytes(read_item, _weights_only_bytes(value, where))


def read_metadata(path: str):
    """The DCP metadata of checkpoint folder `path`, through MetadataUnpickler."""
    return SafeReader(path).read_metadata()
