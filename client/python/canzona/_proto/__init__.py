"""Generated protobuf / gRPC stubs of canzona.v1 (client/python/generate_stubs.py)."""
