"""User-input errors: one exception type raised at the checks, and the CLI wrapper that turns it into one line.

``UserError`` (a ``ValueError``) means "the user asked for something that cannot work" (bad path, key, value or
id); :func:`run_cli` prints ``error: <message>`` on stderr and exits with status 2, without a traceback. Any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["UserError", "MissingPathError", "PathExistsError", "require_path", "run_cli"]

EXIT_USER_ERROR = 2


class UserError(ValueError):
    """A bad path / key / value / id given by the user; the message says what is wrong and what to do."""


class MissingPathError(UserError, FileNotFoundError):
    """A path the user named does not exist."""


class PathExistsError(UserError, FileExistsError):
    """An output path the user named is already taken."""


def require_path(path: str | Path, what: str, hint: str = "", is_dir: bool | None = None) -> Path:
    """``path`` as a Path, or MissingPathError naming ``what`` (+ ``hint``) when it is missing / the wrong kind."""
    p = Path(path)
    ok = p.is_dir() if is_dir else p.is_file() if is_dir is False else p.exists()
    if not ok:
        kind = "directory " if is_dir else "file " if is_dir is False else ""
        raise MissingPathError(f"{what} {kind}{p} does not exist" + (f" ({hint})" if hint else ""))
    return p


def run_cli(main: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``main``; a UserError becomes ``error: <msg>`` on stderr and exit status 2 (no traceback)."""
    try:
        return main(*args, **kwargs)
    except UserError as err:
        msg = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
