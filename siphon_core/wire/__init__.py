"""The wire format: generated protobuf messages, package compression and row tuples."""
