"""Not imported: this folder goes first on the ``PYTHONPATH`` of a CPU engine that returns routed
experts, for its ``sitecustomize`` (that module says why). A regular package, so a wheel carries it."""
