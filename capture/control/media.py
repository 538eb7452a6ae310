"""The media types the control API answers in, shared with its clients: a trainer's side
(capture/client/) imports this module alone of the control plane, so it must stay a module of
constants that any Python the trainers run (3.11 in ``.venv-train``) imports."""

# Rows as an Arrow IPC stream (``Accept`` on ``/sessions/ID/close`` and ``/rollouts``).
ARROW_STREAM = "application/vnd.apache.arrow.stream"
