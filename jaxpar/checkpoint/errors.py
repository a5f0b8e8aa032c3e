"""The checkpoint error, and which exceptions mean "this step's files cannot be used".

Restore falls back to an older step only on damage; anything else is a bug and must propagate,
so the test for damage lives in one place.
"""
from __future__ import annotations

import json
import re
import sys

from jaxpar.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (none good, wrong model, no layout fits): one clear message."""


class StateMismatch(CheckpointError):
    """A whole checkpoint whose state this config does not build (another optimizer, dtypes):
    not damage, so restore stops with it instead of falling back and calling good steps unusable."""


def print_warning(msg: str) -> None:
    print(f"jaxpar: warning: {msg}", file=sys.stderr, flush=True)


# absl status codes tensorstore puts first in the ValueError it raises for a failed read
_STORE_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION", "INVALID_ARGUMENT",
                "PERMISSION_DENIED", "UNAVAILABLE", "UNKNOWN", "INTERNAL", "ABORTED")


def damage(e: BaseException | None) -> BaseException | None:
    """The error in `e`'s cause chain that means "this step's files cannot be used" (missing,
    truncated, not JSON, a checksum mismatch, a tensorstore read error, which orbax wraps in a
    plain Exception), or None: anything else is a bug and propagates."""
    while e is not None:
        if isinstance(e, StateMismatch):  # a config change, never damage
            return None
        if isinstance(e, (CheckpointError, OSError, json.JSONDecodeError, UnicodeDecodeError)):
            return e
        if isinstance(e, ValueError) and str(e).split(":", 1)[0] in _STORE_CODES:
            return e
        e = e.__cause__
    return None


def short(e: BaseException, n: int = 300) -> str:
    """`e` in one line of at most `n` characters, for a warning that names the damaged file."""
    msg = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
    # a tensorstore error: its code and the file, without the driver chain and spec
    msg = re.sub(r'Error opening "\w+" driver: ', "", msg.split(" [tensorstore_spec")[0])
    msg = " ".join(msg.split())
    return msg if len(msg) <= n else msg[:n] + "..."
