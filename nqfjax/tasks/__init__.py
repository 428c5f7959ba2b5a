"""Tasks: what the data contribute to the flow of `M` (`K`, `C`, `E|y|^2`), and the
Lotka-Volterra system of a reducible task."""
