"""Outlier analysis (stats, report) and exact transforms that tame outliers (flatten, smooth)."""
