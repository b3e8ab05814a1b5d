"""The state tree: what a save walks (tree; tensors for PyTorch, arrays for
numpy, modstate for modules), how stored trees are matched to live objects
(match, wrappers), and each rank's own state (own). The schema it writes is
ckpt-core's (``_ckpt.meta``)."""
