"""Placeholder: being written (see the open issues)."""

def structure_from_layer(*args, **kwargs):  # placeholder
    raise NotImplementedError("structure_from_layer is not written yet")

