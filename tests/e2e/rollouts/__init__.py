"""POST /rollouts and its sandboxes, limits and egress; the control API and its clients; the
trainers' adapters (TRL, verl, Ray) and the examples."""
