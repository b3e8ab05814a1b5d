"""The restore path: the plan that places every stored tensor in or beside the live
objects (plan), and the steps of restoring one checkpoint in place (load)."""
