"""Placeholder: being written (see the open issues)."""

def fit_power_law(*args, **kwargs):  # placeholder
    raise NotImplementedError("fit_power_law is not written yet")

def fit_spectrum(*args, **kwargs):  # placeholder
    raise NotImplementedError("fit_spectrum is not written yet")

