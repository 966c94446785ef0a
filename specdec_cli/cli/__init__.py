"""The terminal faces: the Typer app (one error boundary), each command, the display, the chat, doctor,
and the serve command that starts the HTTP server (specdec_cli.serve)."""
