"""Placeholder: being written (see the open issues)."""

def OVAttention(*args, **kwargs):  # placeholder
    raise NotImplementedError("OVAttention is not written yet")

def QKAttention(*args, **kwargs):  # placeholder
    raise NotImplementedError("QKAttention is not written yet")

