"""Averaging within a stage's pool: the butterfly all-reduce's round a replica runs (`butterfly`),
the owner's side of a round (`owner`) and its service (`service`), the channels to the pool's
peers (`channels`), error feedback for lossy codecs (`error_feedback`), and the sums a round
overwrites in place, kept for a retry (`spill`)."""
