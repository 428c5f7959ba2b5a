"""Placeholder: being written (see the open issues)."""

def Task(*args, **kwargs):  # placeholder
    raise NotImplementedError("Task is not written yet")

def gaussian_perceptron_task(*args, **kwargs):  # placeholder
    raise NotImplementedError("gaussian_perceptron_task is not written yet")

def gaussian_quadratic_task(*args, **kwargs):  # placeholder
    raise NotImplementedError("gaussian_quadratic_task is not written yet")

def power_law_task(*args, **kwargs):  # placeholder
    raise NotImplementedError("power_law_task is not written yet")

def task_from_samples(*args, **kwargs):  # placeholder
    raise NotImplementedError("task_from_samples is not written yet")

