"""The former name of ``peers``, kept for the scripts that still import it
(``gpu_bench.py``): everything is in ``peers.py``, beside this file."""

from peers import (  # noqa: F401
    Peak, drop_cache, fsync_path, fsync_tree, fsync_written, settle, tree_bytes, tree_pss,
)
