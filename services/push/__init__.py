"""Pushing an update: what a trainer sends and the atomic push (``docs/parameter-plane.md``)."""
