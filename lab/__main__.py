from lab.cli.main import app

app(prog_name="servelab")
