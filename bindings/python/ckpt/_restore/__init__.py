"""The restore path: the plan that places every stored tensor in or beside the live
objects (plan), the steps of restoring one checkpoint in place (load), and what a restart
passed over, said once (passed)."""
