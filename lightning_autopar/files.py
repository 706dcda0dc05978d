"""Atomic file publication, the one helper every writer uses (checkpoint manifests, monitor CSV/JSON, rank
tables, probed cluster files, plan reports, unit specs): readers see the old file or the new one, never a part."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lightning_autopar.errors import ConfigError


@contextmanager
def atomic_file(path: str | os.PathLike, create_folder: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename (fsynced first, mode
    as a new file gets under the umask), on error it is removed. A missing folder is created (``create_folder``:
    the callbacks' run folders) or, for a command's ``-o`` output, bad input like an unwritable one (ConfigError)."""
    path = Path(path)
    try:
        if create_folder:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix or ".tmp")
    except OSError as err:
        raise ConfigError("output", f"cannot write {path}: {err.strerror}", "choose a writable folder") from None
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to a command's output ``path`` atomically (``atomic_file``; its folder must exist)."""
    with atomic_file(path, create_folder=False) as tmp:
        tmp.write_text(text, encoding="utf-8")


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
