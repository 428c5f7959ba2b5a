"""Placeholder: being written (see the open issues)."""

def sweep(*args, **kwargs):  # placeholder
    raise NotImplementedError("sweep is not written yet")

