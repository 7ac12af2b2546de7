from fp8ptq.cli import app

app()
