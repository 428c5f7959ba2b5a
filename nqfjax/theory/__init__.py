"""Closed forms and limits: switch-on times, the singular-limit staircase, power-law
exponents, converged solutions and weight spectra."""
