"""A peer as the swarm sees it, whatever it serves (a stage server or an aggregator): who it is
(`identity`), its flags (`flags`) and own limits (`limits`), its metrics (`metrics`), how others
reach it (`reachability`), its link rates (`links`); and under a scheduler, its samples/s per
stage (`measure`) and the stage it takes (`moving`)."""
