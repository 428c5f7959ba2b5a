"""The three engines: W-space training, the M-space flow and the Lotka-Volterra
reduction, with the learning-rate clock they share."""
