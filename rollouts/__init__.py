"""The trainer-side Python client of rollouts (``rollouts.client``)."""
