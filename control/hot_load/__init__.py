"""The hot-load workflow, read top to bottom: `workflow.py` (the walk), `broadcast.py` (the first
replica's broadcast to the others: start / ready / abandon / end), `state.py` (the operation and
replica states, memo, search attribute, conditions, the UI's summary and live details) and
`options.py` (activity timeouts and retry policies)."""
