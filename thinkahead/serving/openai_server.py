"""The OpenAI-compatible server's former single module: its names now live in `thinkahead.serving.app`
(routes), `.chat`, `.completions`, `.workflows`, `.tools`, `.limits`, `.metrics`, `.schemas`, `.asgi`."""

from thinkahead.serving.app import ChatServer, create_app
from thinkahead.serving.asgi import RequestError
from thinkahead.serving.limits import ServerSettings

__all__ = ["ChatServer", "RequestError", "ServerSettings", "create_app"]
