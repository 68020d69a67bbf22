"""The folders the admin API writes in: a checkpoint folder it is given is confined
to `<data dir>/checkpoints` (a relative folder is taken there and must stay there) or,
when absolute, to one of `admin.checkpoint_dirs`, after `..` and symbolic links are
resolved, and never to the live data folder around it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .http_errors import BadRequestError, ForbiddenPathError

CHECKPOINTS = "checkpoints"


def checkpoint_folder(given: object, data_dir: Path, allowed: Sequence[Path]) -> Path:
    """Where to make a checkpoint asked for as `given` (the request's "dir")."""
    if not isinstance(given, str) or not given:
        raise BadRequestError('give the checkpoint folder as {"dir": "/some/new/folder"}')
    if "\x00" in given:
        raise BadRequestError(f"the checkpoint folder {given!r} holds a NUL character")
    base = (data_dir / CHECKPOINTS).resolve()
    target = Path(given)
    if target.is_absolute():
        roots = [base, *(Path(root).resolve() for root in allowed)]
    else:  # a relative folder stays in the checkpoints folder
        target, roots = base / target, [base]
    target = target.resolve()
    in_live_data = target.is_relative_to(data_dir.resolve()) and not target.is_relative_to(base)
    if in_live_data or not any(target != root and target.is_relative_to(root)
                               for root in roots):
        raise ForbiddenPathError(
            f"the checkpoint folder {given!r} ({target}) is outside the folders checkpoints "
            f"may be made in: {', '.join(str(root) for root in roots)} (relative folders "
            "are taken under the first; admin.checkpoint_dirs adds others)")
    return target
