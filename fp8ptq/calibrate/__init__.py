"""Sequential calibration: one decoder layer at a time, inputs from the already-quantized layers."""
