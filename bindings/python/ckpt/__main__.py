"""``python -m ckpt``: the ``ckpt`` command (see :mod:`ckpt.cli`)."""

from ckpt.cli import main

main()
