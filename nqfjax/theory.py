"""Placeholder: being written (see the open issues)."""

def Staircase(*args, **kwargs):  # placeholder
    raise NotImplementedError("Staircase is not written yet")

def detect_plateaus(*args, **kwargs):  # placeholder
    raise NotImplementedError("detect_plateaus is not written yet")

def power_law_exponent(*args, **kwargs):  # placeholder
    raise NotImplementedError("power_law_exponent is not written yet")

def sharp_switch_loss(*args, **kwargs):  # placeholder
    raise NotImplementedError("sharp_switch_loss is not written yet")

def singular_limit(*args, **kwargs):  # placeholder
    raise NotImplementedError("singular_limit is not written yet")

def switch_on_times(*args, **kwargs):  # placeholder
    raise NotImplementedError("switch_on_times is not written yet")

