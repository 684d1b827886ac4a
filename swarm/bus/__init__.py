"""The control plane over MQTT: a self-healing connection (`connection`), what its users see
(`api`), one dialled link (`link`), subscriptions and their dispatch (`subscriptions`), this swarm's
topic names and payload types (`topics`), and the embedded broker (`broker`). The MQTT libraries
are imported here and nowhere else."""
