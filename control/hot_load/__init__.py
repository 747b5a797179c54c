"""The hot-load workflow, read top to bottom: `workflow.py` (the walk), `stages.py` (where each
receiver's stage comes from), `fanout.py` (replicas that hold the update pass it on, a few
receivers at a time), `group.py` (a large hot-load's stage groups, one child workflow each),
`window.py` (up to k swaps at once), `state.py` (the operation and replica states, memo, search
attribute, conditions, the UI's summary and live details) and `options.py` (activity timeouts
and retry policies)."""
