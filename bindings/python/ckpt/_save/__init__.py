"""The save path's Python side: lazy-mode hooks that keep a snapshot ahead of the
optimizer (ahead) and the plans that repeat a save of the same state cheaply
(repeat, repeat_host)."""
