"""Typed user-facing errors. Each names the bad value and how to fix it; the CLI prints one line."""

from __future__ import annotations


class Fp8ptqError(Exception):
    """A problem with the user's input, data or environment (not a bug in fp8ptq)."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} (fix: {self.fix})" if self.fix else self.message


class ModelError(Fp8ptqError):
    """The model path, its weights or its architecture cannot be used."""


class RecipeError(Fp8ptqError):
    """A recipe name or file is unknown or invalid."""


class DataError(Fp8ptqError):
    """Calibration or evaluation data is missing, empty or too short."""


class OutputError(Fp8ptqError):
    """The output path exists or cannot be written."""
