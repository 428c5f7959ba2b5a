"""Placeholder: being written (see the open issues)."""

def MixtureOfExperts(*args, **kwargs):  # placeholder
    raise NotImplementedError("MixtureOfExperts is not written yet")

