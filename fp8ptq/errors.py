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


class NonFiniteError(ModelError):
    """A weight, an activation statistic or a scale holds NaN or inf."""


class RecipeError(Fp8ptqError):
    """A recipe name or file is unknown or invalid."""


class DataError(Fp8ptqError):
    """Calibration or evaluation data is missing, empty or too short."""


class OutputError(Fp8ptqError):
    """The output path exists or cannot be written."""


class OptionError(Fp8ptqError):
    """A command-line option (or config field) is out of its allowed range."""


def check_option(flag: str, value, *, minimum=None, maximum=None, note: str = "", example=None) -> None:
    """OptionError naming the flag, the value and the allowed range unless minimum <= value <= maximum
    (None: unbounded; None values pass). note: what is used instead, e.g. the recipe's value."""
    if value is None:
        return
    if (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return
    if minimum is not None and maximum is not None:
        allowed = f"{minimum} to {maximum}"
    else:
        allowed = f">= {minimum}" if minimum is not None else f"<= {maximum}"
    example = example if example is not None else (minimum if minimum is not None else maximum)
    raise OptionError(
        f"{flag} {value} is out of range (allowed: {allowed})" + (f"; {note}" if note else ""),
        fix=f"pass e.g. {flag} {example}",
    )
