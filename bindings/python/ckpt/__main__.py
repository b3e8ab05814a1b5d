"""``python -m ckpt``: the ``ckpt`` command (see :mod:`ckpt.cli`)."""

from .cli import main

main()
