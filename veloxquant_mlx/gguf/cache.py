"""Content-addressed cache folders, filled atomically.

A converted model lives in ``cache_root/gguf/<key>``. It is built in a
temporary folder beside that path and renamed into place only when complete,
so a folder that exists is always whole (a crash mid-way leaves no half
model that a later start would trust), and a failed build leaves nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _missing_dirs(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def build_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build`` into a temporary folder and rename it to ``target``.

    Args:
        target: The final folder; returned at once if it already exists.
        build: Fills the folder it is given; may raise.

    Returns:
        ``target``.

    Raises:
        Whatever ``build`` raises, after removing the temporary folder and any
        parent folders this call created.
    """
    if target.is_dir():
        return target
    created = _missing_dirs(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        # mkdtemp makes the folder private (0700); a model cache is meant to be
        # read like any other installed model, so open it up before publishing.
        tmp.chmod(0o755)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not target.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:  # deepest first; stops at the first non-empty one
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return target
