"""The ``kvdock`` command line."""
