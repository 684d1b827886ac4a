"""A swarm on one machine: starting and stopping its processes (`procs`: the demo, the
benchmarks, the tests) and hosts of their own in network namespaces (`netns`)."""
