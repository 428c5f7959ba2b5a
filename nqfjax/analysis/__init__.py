"""What is measured on loss curves: plateaus, power-law and spectrum fits."""
