"""`tokenspeed serve`: an OpenAI-compatible HTTP worker over one `AsyncEngine`.

The top layer: it imports `runtime`, and nothing below imports it. One file per job:

- `config.py`: `ServerConfig` (host, port, API key, body limit, pending cap, role);
- `served_model.py`: `ServedModel`, the model as the API sees it (name, tokenizer, limits,
  chat template);
- `protocol.py`: request bodies -> prompts and `SamplingParams`, every check up front;
- `role.py`: the seam to the engine (`AggregatedRole`; `make_role` picks by `--role`);
- `pd_roles.py`, `pd_bootstrap.py`: the prefill and decode roles of a P/D split behind smg and
  the bootstrap rendezvous between them;
- `streams.py`: one call's engine requests (prompts x n), merged;
- `deltas.py`: what a streamed choice sends next; `responses.py`: the response objects;
  `sse.py`: the event framing;
- `admission.py`: the cap on waiting + running requests (503) and the shutdown gate;
- `handlers.py`: the two generation endpoints; `app.py`: routes, auth, errors, the small
  endpoints; `metrics.py`: GET /metrics;
- `serve.py`: the socket, signals and graceful shutdown.

See docs/guide.md ("Serving over HTTP").
"""

from .app import build_app
from .config import ServerConfig, ServerConfigError
from .role import AggregatedRole, Role, make_role
from .serve import serve
from .served_model import ServedModel
from .state import ServerState

__all__ = [
    "AggregatedRole",
    "Role",
    "ServedModel",
    "ServerConfig",
    "ServerConfigError",
    "ServerState",
    "build_app",
    "make_role",
    "serve",
]
