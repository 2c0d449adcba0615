"""The OpenAI Batch API on the fleet: `/v1/files` and `/v1/batches` (`routes.py`), kept in a store that
outlives the router (`store.py`: SQLite, or PostgreSQL shared by a tier of routers), and run by each router's
`BatchRunner` (`runner.py`) through the router's own request path at the `batch` class, only into the room
other requests leave (`room.py`). Pure pieces: a file's lines and a line's checks (`lines.py`), the OpenAI
objects (`objects.py`)."""
