"""The ``conveyor`` command line: parses flags and CONVEYOR_* variables, calls the library."""
