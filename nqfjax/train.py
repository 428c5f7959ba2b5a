"""Placeholder: being written (see the open issues)."""

def TrainResult(*args, **kwargs):  # placeholder
    raise NotImplementedError("TrainResult is not written yet")

def train(*args, **kwargs):  # placeholder
    raise NotImplementedError("train is not written yet")

