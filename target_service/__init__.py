"""The target (verify) server: continuous-batching scheduler, REST (OpenAI-compatible) and gRPC front ends."""
