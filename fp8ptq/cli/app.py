"""The typer app and its sub-apps; command modules register on them (fp8ptq/cli/__init__.py imports them)."""

import typer

app = typer.Typer(
    rich_markup_mode=None,
    add_completion=False,
    no_args_is_help=True,
    help="Post-training quantization to compressed-tensors checkpoints for vLLM / SGLang.",
)
recipes_app = typer.Typer(rich_markup_mode=None, no_args_is_help=True, help="Built-in recipes.")
eval_app = typer.Typer(
    rich_markup_mode=None,
    no_args_is_help=True,
    help="Quality under the engine's numerics: KL/PPL, mmlu_pro, lm-eval tasks.",
)
spec_app = typer.Typer(
    rich_markup_mode=None,
    no_args_is_help=True,
    help="Measure a draft against a (quantized) target; recommend γ and engine configs.",
)
app.add_typer(recipes_app, name="recipes")
app.add_typer(eval_app, name="eval")
app.add_typer(spec_app, name="spec")
