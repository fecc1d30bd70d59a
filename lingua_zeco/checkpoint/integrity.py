"""What makes a checkpoint trustworthy: file checksums, finite values, and a usable disk.

* Checksums: after a save every rank hashes the files it wrote (its DCP shards `__{rank}_*.distcp`
  and `rank{rank}.pt`; rank 0 also `.metadata`, `extra.pt` and anything unrecognised); rank 0 stores
  name -> {size, sha256} in the COMPLETE marker. A load verifies them first, each rank a share of the
  files: DCP's format has no checksum of its own, so a byte flipped inside a shard would load as a
  wrong (often NaN) weight without any error.
* Finite values: a state with NaN/inf weights or optimizer moments must never become a checkpoint
  (it would be resumed from, and retention would delete the good ones), nor be resumed from.
* Durable writes: each file goes to a side name, is fsynced, then renamed; a reader never sees half
  a file.
* Storage: a folder is probed (write + fsync + remove) before training, and a failed save names
  ENOSPC/EDQUOT/EROFS, which torch's zip writer reports only as "unexpected pos".
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import stat

import torch

from lingua_zeco.args import ConfigError

_CHUNK = 8 << 20
_OWN = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank(\d+)\.pt)$")  # files named after the rank that wrote them
STORAGE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "read-only file system"}


# -- durable writes ---------------------------------------------------------------------------------
def fsync_dir(path: str):
    # some filesystems refuse fsync on folders (or opening them): the rename order still holds
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_file(obj, path: str, as_json: bool = False):
    """Write to a side name, fsync, then rename: a reader never sees a half-written file."""
    part = path + ".part"
    with open(part, "w" if as_json else "wb") as f:
        if as_json:
            json.dump(obj, f)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


# -- checksums ---------------------------------------------------------------------------------------
def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _owner(name: str) -> int:
    m = _OWN.match(name)
    return int(m.group(1) or m.group(2)) if m else 0


def checksums(folder: str, rank: int, world: int) -> dict[str, dict]:
    """{name: {size, sha256}} of the files of `folder` this rank wrote (rank 0: also the unowned ones)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".part") or not os.path.isfile(path):
            continue
        owner = _owner(name)
        if owner == rank or (rank == 0 and owner >= world):
            out[name] = {"size": os.path.getsize(path), "sha256": sha256(path)}
    return out


def marker_files(marker: dict) -> dict[str, dict] | None:
    """The marker's file list, {name: {size, sha256}}, or None when it is missing, empty or malformed (or
    names a path, not a file of the folder): such a marker (cut short, scribbled over, written by hand)
    proves nothing, so its folder is torn."""
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for name, want in files.items():
        if not (isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("sha256"), str)):
            return None
        if in_folder("", name) is None:  # a path out of the folder: never ours
            return None
    return files


def in_folder(folder: str, name) -> str | None:
    """folder/name for a bare file name read from an artifact (a marker, an export's metadata, an index of
    shards); None for anything that could point elsewhere ("../x", "a/b", "/etc/x", "", "."), and for an entry
    of the folder that leads out of it (a link to elsewhere) or is no regular file (a pipe or a device would
    block its reader). A name that does not exist yet passes: the caller says what is missing."""
    if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name \
            or (os.altsep and os.altsep in name):
        return None
    path = os.path.join(folder, name)
    if folder and os.path.lexists(path):
        real, root = os.path.realpath(path), os.path.realpath(folder)
        if os.path.dirname(real) not in (root, hub_blobs(root)) or not os.path.isfile(real):
            return None
    return path


def hub_blobs(root: str) -> str | None:
    """The blobs folder of a Hugging Face hub cache entry when `root` is one of its snapshots
    (models--<org>--<name>/snapshots/<revision>, whose files are links to models--<org>--<name>/blobs/<hash>):
    the same downloaded repository, so a snapshot is read in place, as `snapshot_download` leaves it."""
    snapshots = os.path.dirname(root)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or not os.path.basename(repo).startswith("models--"):
        return None
    return os.path.join(repo, "blobs")


def folder_file(folder: str, name: str) -> str | None:
    """folder/name for a fixed file name of an artifact (config.json, model.safetensors, a tokenizer file) when
    it is a file of the folder; None when there is no such entry. An entry that leads out of the folder (a link
    elsewhere) or is no file (a pipe) is refused with a ConfigError, not taken for absent: a folder whose
    tokenizer is a link would otherwise run on another tokenizer without a word."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    if in_folder(folder, name) is None or not os.path.isfile(path):
        raise ConfigError(f"{path} is a link out of its folder or no regular file: refused (nothing outside an "
                          f"artifact's folder is read); copy the file itself into the folder")
    return path


def regular_file(path: str) -> bool:
    """A regular file, not a link: a checkpoint's writer makes nothing else, and reading a pipe or a device
    named like one of its files could block forever or never end."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def verify(folder: str, files: dict[str, dict], rank: int, world: int) -> list[str]:
    """Problems with this rank's share of `files` (every world-th file, by name): missing, size, hash."""
    problems = []
    for name in sorted(files)[rank::world]:
        path, want = os.path.join(folder, name), files[name]
        try:
            size = os.path.getsize(path)
        except OSError:
            problems.append(f"{name} missing")
            continue
        if not regular_file(path):
            problems.append(f"{name} is not a regular file (a link, a pipe or a device)")
            continue
        if size != want["size"]:
            problems.append(f"{name} has {size} bytes, {want['size']} written")
        elif sha256(path) != want["sha256"]:
            problems.append(f"{name} checksum mismatch")
    return problems


# -- finite values -----------------------------------------------------------------------------------
def _tensors(obj, prefix: str = ""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}{i}.")
    elif isinstance(obj, torch.Tensor) and obj.is_floating_point():
        yield prefix[:-1], obj.to_local() if hasattr(obj, "to_local") else obj


def nonfinite(state: dict) -> list[str]:
    """Names of the floating tensors of `state` (this rank's shards) holding NaN or inf. One host sync
    per device (optimizers may keep some state on the CPU beside CUDA weights, e.g. AdamW's `step`)."""
    by_device: dict = {}
    for n, t in _tensors(state):
        if t.numel():
            by_device.setdefault(t.device, []).append((n, t))
    bad = []
    for named in by_device.values():
        flags = torch.stack([~torch.isfinite(t).all() for _, t in named]).cpu()
        bad += [n for (n, _), b in zip(named, flags.tolist()) if b]
    return bad


# -- storage -----------------------------------------------------------------------------------------
def probe_writable(folder: str) -> None:
    """Create `folder`, then write, fsync and remove a small file in it; raises the OSError if it cannot."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f".write_probe_{socket.gethostname()}_{os.getpid()}")  # ranks of all nodes
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _causes(e: BaseException):
    seen = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        stack += [x.__cause__, x.__context__]
        # DCP's CheckpointException: {rank: (exception, traceback summary)}
        stack += [v[0] if isinstance(v, tuple) else v for v in (getattr(x, "failures", None) or {}).values()]


def cause_of(e: BaseException, kind: type) -> BaseException | None:
    """The first exception of type `kind` in e's causes (DCP wraps every rank's failure), else None."""
    return next((x for x in _causes(e) if isinstance(x, kind)), None)


def reraise_interrupt(e: BaseException) -> None:
    """Ctrl-C inside a DCP call arrives wrapped in its CheckpointException: raise it as the
    KeyboardInterrupt it is, not as a damaged checkpoint (which would start a fallback)."""
    if cause_of(e, KeyboardInterrupt) is not None:
        raise KeyboardInterrupt from e


def root_cause(e: BaseException) -> str:
    """One line for a failure: the innermost exception's message (DCP's own message is a traceback dump)."""
    x = e
    while True:
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict) and failures:
            v = next(iter(failures.values()))
            x = v[0] if isinstance(v, tuple) else v
        elif x.__cause__ is not None:
            x = x.__cause__
        else:
            break
    text = str(x).strip().splitlines()
    return f"{type(x).__name__}: {text[0][:300] if text else ''}"


def storage_problem(e: BaseException, folder: str) -> str | None:
    """'no space left on device (ENOSPC)' etc. when that is why writing to `folder` failed, else None.
    torch.save's zip writer loses the errno ("unexpected pos"), so a full disk is also asked directly."""
    for x in _causes(e):
        if isinstance(x, OSError) and x.errno in STORAGE_ERRNOS:
            return f"{STORAGE_ERRNOS[x.errno]} ({errno.errorcode[x.errno]})"
    try:
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize < (1 << 20):
            return f"{STORAGE_ERRNOS[errno.ENOSPC]} (ENOSPC; {st.f_bavail * st.f_frsize} bytes free)"
        probe_writable(folder)
    except OSError as x:
        if x.errno in STORAGE_ERRNOS:
            return f"{STORAGE_ERRNOS[x.errno]} ({errno.errorcode[x.errno]})"
    return None
