"""The ``ckpt`` command (console script and ``python -m ckpt``).

It runs the same Rust code as the ``ckpt`` binary of the ``ckpt-cli`` crate:
``ckpt list URL [--verify] [--json]``, ``verify``, ``gc``, ``convert``, ``export``
(``ckpt --help``).
"""

from __future__ import annotations

import sys
from typing import List, Optional

from ckpt import _ckpt

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``ckpt`` with ``argv`` (default: this process's arguments); exits with its status."""
    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    code = _ckpt.cli_main(["ckpt", *args])
    if argv is None:
        sys.exit(code)
    return code
