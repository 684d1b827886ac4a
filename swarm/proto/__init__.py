"""Generated protobuf and gRPC code; regenerate with `make protos`, never edit by hand."""
