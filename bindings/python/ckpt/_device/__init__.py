"""Device staging: CUDA snapshots through host slabs (cuda), the slab pool under
the staging budget (slabs), and a restore's host stage (hoststage)."""
