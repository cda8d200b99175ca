"""Taking state out of Redis and back: checkpoints, consistent cuts, exports and table pieces
(``docs/parameter-plane.md``, ``docs/embeddings.md``)."""
