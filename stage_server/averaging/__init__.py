"""Averaging within a stage's pool: the butterfly all-reduce a replica runs (`butterfly`),
the owner's side of a round (`owner`), and error feedback for lossy codecs (`error_feedback`)."""
