"""Schemes -> per-module plans, and the fake-quant numerics shared by calibration and evaluation."""
