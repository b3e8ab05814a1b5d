"""Sharded state: DTensor placements as the boxes ckpt stores (dtensor)."""
