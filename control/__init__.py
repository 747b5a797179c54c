"""The control worker's workflows (deployment, gateway, hot-load) and its activities."""
