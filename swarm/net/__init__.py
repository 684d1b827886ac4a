"""Who may talk to whom, and where: bound and announced addresses (`addresses`), the shared token
(`tokens`), TLS identities (`tls`) and the swarm's own certificate authority (`certs`)."""
