"""Running a swarm process: serving its metrics (`metrics`), its lifecycle (`lifecycle`), the
per-step progress records (`progress`) and fault injection (`faults`)."""
