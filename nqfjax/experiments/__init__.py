"""Drivers that combine the engines and write results: the demo, TOML sweeps, a
user's curve, training methods, delayed generalisation, the finite-data map."""
