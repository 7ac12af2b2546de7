"""The steps of a quantize run (fp8ptq.api.quantize): context and validation, the calibrated and
data-free paths, the finish."""
