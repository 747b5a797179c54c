"""What the control plane and the replicas agree on: the records workflows keep, activity inputs
and outputs, workflow/update/signal/activity names and task queues, search attributes, and the
ApplicationError types."""
