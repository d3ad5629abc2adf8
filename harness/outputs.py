"""Writing output files atomically: each to a temporary name beside it, then renamed into place.

A report, comparison or index is a set of files (Markdown, HTML, JSON). `write_files` writes all
of them to temporary names first and renames them only when every one is complete, so a full or
unwritable destination leaves no partial file (and no temporary one): the old files stay as
they were, and the error is one line (`OutputError`: exit 3 for a full or failing disk, 2 for a
place that cannot be written).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from kvfid.errors import EXIT_ENVIRONMENT, EXIT_USAGE, OutputError

_DISK = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


def write_files(files: dict[str, tuple[Path, str]]) -> dict[str, Path]:
    """Write {name: (path, text)} all-or-nothing; returns {name: path}."""
    temporary: list[Path] = []
    target = None
    try:
        for target, text in files.values():
            target = Path(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            temporary.append(temp)
            write_text(temp, text)
        for (target, _), temp in zip(files.values(), temporary):
            os.replace(temp, target)
    except OSError as err:
        for temp in temporary:
            temp.unlink(missing_ok=True)
        code = EXIT_ENVIRONMENT if err.errno in _DISK else EXIT_USAGE
        where = err.filename or target
        raise OutputError(f"{where}: cannot write the output ({err.strerror or err}); nothing "
                          f"was written there", code) from None
    return {name: Path(path) for name, (path, _) in files.items()}


def write_text(path: Path, text: str) -> None:
    """Write `text` as UTF-8 to a new file at `path` and flush it to the disk."""
    path.unlink(missing_ok=True)            # a temporary name left by a killed process
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
