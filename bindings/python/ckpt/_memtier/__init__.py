"""The memory tier's parts: a memory root seen through the engine (root), the ring's
buffered transfers (wire), and restores into a job of another shape (reshape)."""
