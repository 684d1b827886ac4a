"""Tensors on the wire: the codecs (`codec`, with the `hadamard` rotation) and the chunked
streaming of messages that carry them (`chunking`)."""
