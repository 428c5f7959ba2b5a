"""Placeholder: being written (see the open issues)."""

def solve_mflow(*args, **kwargs):  # placeholder
    raise NotImplementedError("solve_mflow is not written yet")

