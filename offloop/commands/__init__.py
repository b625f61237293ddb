"""One module per `offloop` command; each defines add_arguments() and run()."""
