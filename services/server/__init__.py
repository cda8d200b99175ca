"""The parameter-server service (``streamtrain ps``): the apply loop, replay, persist (``docs/parameter-plane.md``)."""
