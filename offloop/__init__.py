"""The `offloop` command line: one module per command, heavy imports inside each.

This package is the one place that sees `trainer`, `workers` and `bus` together;
they never import it.
"""
