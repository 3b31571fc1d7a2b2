"""The model shard: gRPC service, cached batch state, model runner, KV pool."""
