from lab.cli.main import main

main(prog_name="servelab")
