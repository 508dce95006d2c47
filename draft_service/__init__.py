"""gRPC draft server (specdec.v1.Drafter): `python -m draft_service --drafter ngram|layer-skip|<model>`."""
from .server import build_server, serve

__all__ = ["build_server", "serve"]
