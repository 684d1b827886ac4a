"""The pure policies every role uses: stochastic wiring (`wiring`, one stage's pool
`stage_pool`), placement (`placement`, its search `placement_search`), rebalancing
(`rebalance`) and the one retry pause (`backoff`). Plain functions over plain data, driven by the
simulator too: no torch, gRPC, MQTT or Prometheus here."""
